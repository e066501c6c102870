"""The named presets (`--config NAME`) as YAML files; driver/presets.py reads them."""
