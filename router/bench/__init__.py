"""Load generators and baselines for the router's e2e tests and benchmarks."""
