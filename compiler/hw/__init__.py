"""What the compiler builds for: targets (target), the per-architecture hardware table (hardware) and
the host CPU's detection (hostcpu)."""
