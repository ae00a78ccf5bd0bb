"""The video engine: diffusers text/image-to-video pipelines, encoded to MP4."""
