"""Scheduling and KV-cache bookkeeping: requests, block pool, cache manager, scheduler."""
