"""Telemetry shared by every process: counters, histograms, latency trackers, Prometheus exposition and
throttled logs.  A leaf: it imports nothing of ours."""
