"""Speed: timing, `fuseguard bench`, the gate's statistics (gate) and stored baselines (baselines,
latency), A/B against a base revision (ab), history, the per-group profile, tune, cliff and fusion-pays."""
