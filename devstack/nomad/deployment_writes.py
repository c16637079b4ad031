"""Deployment writes (`nomad/deployment_endpoint.go`) and the evaluation the deployment watcher
creates when a deployment changes."""

from __future__ import annotations

from typing import Any

from devstack.nomad import deployments
from devstack.nomad.answers import ApiError, write_meta
from devstack.nomad.reconcile import new_eval
from devstack.nomad.server_parts import Json, ServerParts


class DeploymentWrites(ServerParts):
    # ----- deployments (nomad/deployment_endpoint.go, deploymentwatcher) ----------------------

    def deployment(self, deployment_id: str) -> Json:
        found = self.store.deployments.get(deployment_id)
        if found is None:
            raise ApiError(404, "deployment not found")
        return found

    def deployment_eval(self, deployment: Json, triggered_by: str = "deployment-watcher") -> Json | None:
        """The evaluation the deployment watcher creates so the scheduler acts on a change."""
        job = self.store.jobs.get((deployment["Namespace"], deployment["JobID"]))
        if job is None:
            return None
        evaluation = new_eval(job, triggered_by, self.clock.now_ns(), DeploymentID=deployment["ID"])
        self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return evaluation

    def _deployment_write(
        self, deployment_id: str, status: str, description: str, terminal_error: str
    ) -> Json:
        with self.store.batch():
            found = self.store.deployments.get(deployment_id)
            if found is None:
                # Behind the RPC boundary, so Nomad answers 500 with the error's text.
                raise ApiError(500, "deployment not found")
            if not deployments.is_active(found):
                raise ApiError(500, terminal_error)
            self.store.upsert_deployment(
                deployments.with_status(found, status, description, self.clock.now_ns())
            )
            evaluation = self.deployment_eval(self.store.deployments[deployment_id])
        index = self.store.index
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": index if evaluation else 0,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            **write_meta(index),
        }

    def fail_deployment(self, deployment_id: str) -> Json:
        return self._deployment_write(
            deployment_id, deployments.FAILED, deployments.DESC_FAILED_BY_USER, deployments.ERR_NO_FAIL
        )

    def pause_deployment(self, deployment_id: str, body: Any) -> Json:
        pause = bool(body.get("Pause")) if isinstance(body, dict) else False
        if pause:
            return self._deployment_write(
                deployment_id, deployments.PAUSED, deployments.DESC_PAUSED, deployments.ERR_NO_PAUSE
            )
        return self._deployment_write(
            deployment_id, deployments.RUNNING, deployments.DESC_RUNNING, deployments.ERR_NO_RESUME
        )

    def promote_deployment(self, deployment_id: str, body: Any) -> Json:
        """`UpdateDeploymentPromotion`: marks the named groups (or all) promoted and gives each a
        full progress deadline from now. The stand-in places no canaries, so no group waits for
        healthy ones; Nomad too accepts a promotion of groups that want none (it has no "no
        canaries" refusal), and still creates the watcher's evaluation."""
        body = body if isinstance(body, dict) else {}
        groups = set(body.get("Groups") or [])
        now = self.clock.now_ns()
        with self.store.batch():
            found = self.store.deployments.get(deployment_id)
            if found is None:
                raise ApiError(500, "deployment not found")
            if not deployments.is_active(found):
                raise ApiError(500, deployments.ERR_NO_PROMOTE)
            states = {
                name: deployments.promoted(state, now) if body.get("All") or name in groups else state
                for name, state in found["TaskGroups"].items()
            }
            self.store.upsert_deployment({**found, "TaskGroups": states, "ModifyTime": now})
            evaluation = self.deployment_eval(self.store.deployments[deployment_id])
        index = self.store.index
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": index if evaluation else 0,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            **write_meta(index),
        }
