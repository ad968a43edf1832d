"""The shipped config files (YAML): the demo's, the data recipes' and the published training recipes'.

Installed as `hylo.configs` (package data), found by import in a checkout and an installed package alike
(`hylo.pipeline.config.shipped_configs`): `--config NAME.yaml` of any job reads one by name, and `hylo configs`
lists them and copies one out to edit. The symlink hylo/configs maps the folder to that name; imported under
another (the top-level `configs`, when a checkout's root is on sys.path), it refuses.
"""

if __name__ != "hylo.configs":
    raise ImportError(f"the folder configs/ is the package hylo.configs: import hylo.configs, not {__name__}")
