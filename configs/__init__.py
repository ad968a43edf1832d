"""The shipped config files (YAML): the demo's, the data recipes' and the published training recipes'.

Installed as `hylo.configs` (package data), found by import in a checkout and an installed package alike
(`hylo.pipeline.config.shipped_configs`): `--config NAME.yaml` of any job reads one by name, and `hylo configs`
lists them and copies one out to edit.
"""
