"""Hydra launcher plugin for ``hydra/launcher=ray``: hydra-ray-launcher's launcher, with one change of
rule: a point whose task dies with its worker or node is a FAILED point,
not the end of the sweep.

The plugin gathers its tasks with one ``ray.get`` after another, so the first
lost task raises in the driver: the sweep stops, its parent run stays
RUNNING and the points still running elsewhere are never collected. Here
each task is gathered on its own; a task that fails (the node died, the
worker was killed, the point raised on its worker) has its point recorded
FAILED with the reason (:func:`quantlab.pipeline.record_lost`: "node or
worker lost (NodeDiedError: ...)"), every other point is collected as it
ends, the parent run closes, and the sweep exits 1 like any sweep with a
failed point. Ray does not retry a point (``max_retries: 0`` in the preset:
a retry would time it on another node, beside a half-logged first try);
rerunning the same command redoes the lost point and reuses the rest.
``address: null`` starts a Ray instance of the sweep's own (Ray's own
``None`` would join any cluster another process on this machine runs).

Hydra instantiates launchers only from the ``hydra_plugins`` package and
imports every module there at start-up: this one defines its class only where
the plugin is installed (the ``ray`` extra) and imports Ray only when it
launches.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

log = logging.getLogger("quantlab")


def lost_reason(e: BaseException) -> str:
    """One line for a task that did not come back."""
    import ray

    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, ray.exceptions.RayTaskError):
        return f"the point raised on its Ray worker: {first}"
    return f"node or worker lost ({type(e).__name__}: {first})"


if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None:
    from hydra_plugins.hydra_ray_launcher import ray_launcher

    class RayLauncher(ray_launcher.RayLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence:
            from pathlib import Path

            import ray
            from hydra.core.singleton import Singleton
            from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
            from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray, start_ray
            from omegaconf import open_dict

            from quantlab.cli import to_point
            from quantlab.pipeline import record_lost
            from quantlab.point import parent_run

            setup_globals()
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            if self.ray_cfg.init.get("address") is None:  # a local instance of its own: the plugin's small
                with open_dict(self.ray_cfg):  # object store; "local", or Ray attaches to whatever cluster
                    self.ray_cfg.init.address = "local"  # this machine last started (/tmp/ray/ray_current_cluster)
                    self.ray_cfg.init.setdefault("object_store_memory", 78643200)
            start_ray(self.ray_cfg.init)
            tasks = []
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
                log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
                job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(job_cfg):
                    job_cfg.hydra.job.id, job_cfg.hydra.job.num = f"job_id_for_{idx}", idx
                tasks.append((job_cfg, overrides, launch_job_on_ray(
                    self.hydra_context, self.ray_cfg.remote, job_cfg, self.task_function, Singleton.get_state())))
            returns = []
            for job_cfg, overrides, task in tasks:
                try:
                    returns.append(ray.get(task))
                except ray.exceptions.RayError as e:
                    point_cfg = job_cfg.copy()
                    with open_dict(point_cfg):
                        del point_cfg["hydra"]  # the task function's view of the job's config
                    record_lost(to_point(point_cfg), lost_reason(e), parent_run())
                    returns.append(JobReturn(overrides=list(overrides), cfg=job_cfg, status=JobStatus.COMPLETED,
                                             _return_value=None))
            return returns
