"""Base station and cloud: FedGS super-node selection, internal and external sync."""
