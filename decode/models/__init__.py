"""The draft models draftops trains: a layer subset of the target, and the EAGLE-3 feature draft."""
