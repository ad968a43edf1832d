"""What the tests share, one module per part: `common` (relative-RMS checks, the one-thread fixture, the
linear-recurrence kernels' and layers' checks, top-k records, a clean source copy), `models` (configs of tiny
and published models), `cli` (`hylo` in-process, the job configs' fields), `data`, `teacher`, `train`
(tiny models and configs, a local S3, torchrun), `cluster` (a multi-node Ray on this machine), `ray_logs` (what
Ray's workers printed, read from their log files), `logs` (the lines a job logged: time, level, rank and
message), `released` and `xecomla` (AMD's checkpoint layouts and their forward), `fla_interpret` (fla's
kernels through Triton's interpreter; also a script) and `sp_group` (gloo ranks in spawned processes).

Nothing is imported here: `fla_interpret` must be imported before fla, and a spawned rank imports only what
its function needs."""
