"""Image engines: diffusers pipelines that draw and edit images."""
