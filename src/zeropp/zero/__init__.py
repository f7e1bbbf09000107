"""Training-step state machines for the ZeRO stages."""
