"""The test suite: one folder per library package, tests/project/ for the repository, tests/support/
for what they share (docs/architecture.md, "Where the tests live")."""
