"""The store's schema history (Alembic), applied by ``SqlStore.start``.

A schema change is a new file in ``versions/`` whose ``down_revision`` is the current
head, written by hand like ``0001_initial.py`` (no alembic.ini: ``engine.upgrade_schema``
configures Alembic in code), together with the matching change to ``tables.py``; the unit
tests check that the migrated schema and ``tables.py`` agree.
"""
