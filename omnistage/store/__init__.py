"""Durable state: jobs, stored responses and their media (see ``base.Store``)."""
