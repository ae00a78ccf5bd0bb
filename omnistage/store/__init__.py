"""Durable state: jobs, stored responses and their media (see ``base.Store``).

``open`` opens the store for a --store-url; ``records`` holds the rows the routes and the
job runner pass around (cheap to import: the SQL side loads when a store is opened).
"""
