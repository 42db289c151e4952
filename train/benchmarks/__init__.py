"""What the benchmark scripts run (scripts/bench_*.py): this framework against plain TRL."""
