"""Training engines (DDP, FSDP2, DeepSpeed ZeRO) behind one interface."""
