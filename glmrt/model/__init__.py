"""The GLM-5.3-Flash model definition (text, vision, layers, loader)."""
