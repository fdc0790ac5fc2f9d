"""Where captured artefacts go: files on disk and VisualDL."""
