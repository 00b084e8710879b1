"""The lab: make rehearse, OpenWebMath's scale rehearsed on CPUs with the rehearsal teacher (docs/sizing-a-run.md#rehearsing-at-scale)."""
