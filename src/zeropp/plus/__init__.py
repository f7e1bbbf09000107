"""ZeRO++ as strategies the stage-3 engine is handed: qwZ (quantized gather), hpZ (secondary partition),
qgZ (quantized two-hop gradient reduction)."""
