"""Trace replay through the control-plane index: `run` (the replay and its Belady bound),
`bound` (the online admission bound), `trace` (reading traces), `plot` (PNG figures)."""
