"""Operations: the interval planner and the run timeline report. Imports ``certckpt.trust``."""
