"""The lab: make rehearse, OpenWebMath's scale rehearsed on CPUs with the rehearsal teacher (docs/running-at-scale.md#rehearsing-at-scale)."""
