"""No tests: helpers, per-rank case modules and references the test folders import (``tests.support.NAME``)."""
