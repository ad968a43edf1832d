"""The teacher: per-row top-k / logit computation, a Ray Serve pool, its client, and an offline top-k cache.

* `sources.open_teacher(cfg, vocab) -> BoundTeacher`  one object: `targets(rows, device)` yields each row's
  teacher arguments of `fused_linear_kl_div`, whichever source (`TeacherSource`) gives them.
* `sources/`  one file per value of `teacher.source` (inprocess, serve, offline) and the registry of them:
  each source's keys (its typed section in `config.py`), config check, checks before Ray starts, resources, pool
  start, where its model runs and opening.
* `model.TeacherModel`  plain torch, usable in-process (documents of a packed row isolated).
* `serve.start_teacher_pool(model_cfg, pool_cfg, fault_cfg) -> DeploymentHandle`  the Serve pool.
* `client.TeacherClient(handle_or_app_name, ...)`  ordered, bounded, retrying requests.
* `cache.run_cache_job(cfg)` / `cache.TopKCacheReader(dir, ...)`  offline shards for stage 2.
Submodules are imported on demand: importing this package pulls in neither Ray nor transformers.
"""
