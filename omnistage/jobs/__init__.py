"""Long generations run as jobs: created by a route, kept in the store, run by the head
that claims them (``runner.JobRunner``), one handler per kind of job."""
