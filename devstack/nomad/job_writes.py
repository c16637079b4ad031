"""Job writes as `nomad/job_endpoint.go` makes them: admission (canonicalise, then the
validators in Nomad's order), register, deregister, scale, evaluate, the scale status, validate,
an allocation's stop and `/v1/jobs/parse`. Each checks the request, writes in one batch (one
index), creates the evaluation and hands it to the scheduler."""

from __future__ import annotations

import copy
from typing import Any

from devstack.nomad import deployments, namespaces
from devstack.nomad.answers import ApiError, write_meta
from devstack.nomad.canonical import canonicalize_job, spec_changed
from devstack.nomad.jobspec import JobspecError, parse_jobspec, parse_variables_file
from devstack.nomad.operator import ERR_REGISTRATION_DISABLED
from devstack.nomad.reconcile import TERMINAL_CLIENT, new_eval
from devstack.nomad.server_parts import Json, ServerParts
from devstack.nomad.validate import JobError, multierror_text, validate_job


class JobWrites(ServerParts):
    # ----- jobs ----------------------------------------------------------------------------

    def admit(self, raw: Json, query_ns: str | None, now: int) -> Json:
        """What Nomad does to a submitted job before it registers or plans it: the namespace
        defaulted from the query, canonicalisation, then the admission validators in Nomad's
        order (the namespace exists and allows the job's drivers, the node pool exists, the job
        is valid), whose refusals come back together as one multierror with no status code (500)."""
        if not raw.get("Namespace") and query_ns:
            raw = {**raw, "Namespace": query_ns}
        try:
            job = canonicalize_job(raw, now)
        except JobError as exc:
            raise ApiError(exc.code, str(exc)) from None
        problems = [
            *namespaces.admission_problems(self.store, job),
            *self._node_pool_problems(job),
            *validate_job(job),
        ]
        if problems:
            raise ApiError(500, multierror_text(problems))
        return job

    def _node_pool_problems(self, job: Json) -> list[str]:
        # A node joining a pool creates it; a job in a pool that no node has is refused at
        # registration by Nomad's jobNodePoolValidatingHook.
        pool = job.get("NodePool") or "default"
        known = {"default", "all"} | {n.get("NodePool") or "default" for n in self.store.nodes.values()}
        if pool not in known:
            return [f'job "{job["ID"]}" is in nonexistent node pool "{pool}"']
        return []

    def _registrations_allowed(self) -> None:
        # `registrationsAreAllowed`: with RejectJobRegistration on, only a management token may
        # register or scale, and without ACLs there is none.
        if self.scheduler_config.rejects_registration:
            raise ApiError(403, ERR_REGISTRATION_DISABLED)

    def register(self, body: Any, path_id: str | None = None, query_ns: str | None = None) -> Json:
        if not isinstance(body, dict) or not isinstance(body.get("Job"), dict):
            raise ApiError(400, "Job must be specified")
        raw = body["Job"]
        if not raw.get("ID"):
            raise ApiError(400, "Job ID hasn't been provided")
        if path_id is not None and raw["ID"] != path_id:
            raise ApiError(400, "Job ID does not match name")
        if raw.get("Type") == "system" and any(
            isinstance(g, dict) and g.get("Scaling") for g in raw.get("TaskGroups") or []
        ):
            raise ApiError(400, "Task groups with job type system do not support scaling blocks")
        self._registrations_allowed()
        now = self.clock.now_ns()
        job = self.admit(raw, query_ns, now)
        key = (job["Namespace"], job["ID"])
        existing = self.store.jobs.get(key)
        if body.get("EnforceIndex"):
            want = int(body.get("JobModifyIndex") or 0)
            if want == 0 and existing is not None:
                raise ApiError(500, "Enforcing job modify index 0: job already exists")
            if want and existing is None:
                raise ApiError(500, f"Enforcing job modify index {want}: job does not exist")
            if want and existing is not None and existing["JobModifyIndex"] != want:
                raise ApiError(
                    500,
                    f"Enforcing job modify index {want}: job exists with conflicting job modify "
                    f"index: {existing['JobModifyIndex']}",
                )
        if existing is not None:
            old_groups = {g["Name"]: g for g in existing["TaskGroups"]}
            for group in job["TaskGroups"]:
                old = old_groups.get(group["Name"])
                if old is None:
                    continue
                if body.get("PreserveCounts"):
                    group["Count"] = old["Count"]
                if group.get("Scaling") and old.get("Scaling"):
                    group["Scaling"]["ID"] = old["Scaling"]["ID"]
        with self.store.batch():
            if existing is None or spec_changed(existing, job):
                job["Version"] = existing["Version"] + 1 if existing else 0
                job["Status"] = existing["Status"] if existing else "pending"
                job["JobModifyIndex"] = self.store.next_index()
                self.store.upsert_job(job)
            else:
                job = existing
            evaluation = new_eval(job, "job-register", now)
            self.store.upsert_eval(evaluation)
            self.scheduler.refresh_job_in_batch(job["Namespace"], job["ID"])
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": self.store.jobs[key]["JobModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def job(self, ns: str, job_id: str) -> Json:
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(404, "job not found")
        return job

    def deregister(self, ns: str, job_id: str, purge: bool) -> Json:
        key = (ns, job_id)
        job = self.store.jobs.get(key)
        if job is None:
            # Nomad answers a deregister of an unknown job without an evaluation.
            return {
                "EvalID": "",
                "EvalCreateIndex": 0,
                "JobModifyIndex": 0,
                "VolumeEvalID": "",
                "VolumeEvalIndex": 0,
                **write_meta(self.store.index),
            }
        now = self.clock.now_ns()
        with self.store.batch():
            index = self.store.next_index()
            if purge:
                self.store.delete_job(ns, job_id)
                eval_job = job
            else:
                # A stop keeps the version (`upsertJobImpl` with keepVersion).
                eval_job = {**job, "Stop": True, "JobModifyIndex": index}
                self.store.upsert_job(eval_job, "JobDeregistered")
            evaluation = new_eval(eval_job, "job-deregister", now, JobModifyIndex=index)
            self.store.upsert_eval(evaluation)
            self.scheduler.untrack(ns, job_id)
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": index,
            "VolumeEvalID": "",
            "VolumeEvalIndex": 0,
            **write_meta(self.store.index),
        }

    def scale(self, ns: str, job_id: str, body: Any) -> Json:
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        target = body.get("Target") or {}
        if not isinstance(target, dict):
            raise ApiError(400, "Request decode failed: Target must be an object")
        count = body.get("Count")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise ApiError(400, "Request decode failed: Count must be an integer")
        self._registrations_allowed()  # in Job.Scale before its arguments are validated
        if target.get("Job") and target["Job"] != job_id:
            raise ApiError(400, "job ID in payload did not match URL")
        group_name = target.get("Group")
        if not group_name:
            raise ApiError(400, "missing task group name for scaling action")
        if count is not None and count < 0:
            raise ApiError(400, "scaling action count can't be negative")
        if count is not None and body.get("Error"):
            raise ApiError(400, "scaling action should not contain count if error is true")
        key = (ns, job_id)
        job = self.store.jobs.get(key)
        if job is None:
            raise ApiError(404, f'job "{job_id}" not found')
        group = next((g for g in job["TaskGroups"] if g["Name"] == group_name), None)
        if group is None:
            raise ApiError(400, f'task group "{group_name}" specified for scaling does not exist in job')
        scaling = group.get("Scaling")
        if count is not None and scaling and not body.get("PolicyOverride"):
            if scaling.get("Min") is not None and count < scaling["Min"]:
                raise ApiError(
                    400, f"group count was less than scaling policy minimum: {count} < {scaling['Min']}"
                )
            if scaling.get("Max") is not None and count > scaling["Max"]:
                raise ApiError(
                    400, f"group count was greater than scaling policy maximum: {count} > {scaling['Max']}"
                )
        if count is not None and job["Type"] == "system" and count > 1:
            raise ApiError(400, 'jobs of type "system" can only be scaled between 0 and 1')
        if count is not None and deployments.scale_blocked(self.store, job):
            raise ApiError(400, deployments.ERR_SCALE_BLOCKED)
        now = self.clock.now_ns()
        previous = group["Count"]
        evaluation: Json | None = None
        with self.store.batch():
            index = self.store.next_index()
            if count is not None:
                new_job = copy.deepcopy(job)
                for g in new_job["TaskGroups"]:
                    if g["Name"] == group_name:
                        g["Count"] = count
                new_job["Version"] = job["Version"] + 1
                new_job["JobModifyIndex"] = index
                new_job["SubmitTime"] = now
                self.store.upsert_job(new_job)
                evaluation = new_eval(new_job, "job-scaling", now)
                self.store.upsert_eval(evaluation)
            self.store.add_scaling_event(
                ns,
                job_id,
                group_name,
                {
                    "Time": now,
                    "Count": count,
                    "PreviousCount": previous,
                    "Message": body.get("Message") or "",
                    "Error": bool(body.get("Error")),
                    "Meta": body.get("Meta"),
                    "EvalID": evaluation["ID"] if evaluation else None,
                    "CreateIndex": index,
                },
            )
            if evaluation is not None:
                self.scheduler.refresh_job_in_batch(ns, job_id)
        if evaluation is not None:
            self.scheduler.submit(evaluation)
        job = self.store.jobs[key]
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": evaluation["CreateIndex"] if evaluation else 0,
            "JobModifyIndex": job["JobModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def evaluate(self, ns: str, job_id: str, body: Any) -> Json:
        """`Job.Evaluate` (`nomad job eval [-force-reschedule]`, nomad/job_endpoint.go): a new
        evaluation of the job; with `EvalOptions.ForceReschedule`, every failed allocation that
        Nomad has not replaced is marked `DesiredTransition.ForceReschedule`, and the
        reconciler replaces it now, whatever its reschedule policy has left."""
        if body is not None and not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        options = (body or {}).get("EvalOptions") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "Request decode failed: EvalOptions must be an object")
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(500, "job not found")
        if job.get("Periodic"):
            raise ApiError(500, "can't evaluate periodic job")
        if job.get("ParameterizedJob"):
            raise ApiError(500, "can't evaluate parameterized job")
        now = self.clock.now_ns()
        groups = {g["Name"]: g for g in job["TaskGroups"]}
        with self.store.batch():
            if options.get("ForceReschedule"):
                for alloc in self.store.allocs_for_job(ns, job_id):
                    policy = (groups.get(alloc["TaskGroup"]) or {}).get("ReschedulePolicy") or {}
                    # ReschedulePolicy.Enabled: attempts left to give, or unlimited.
                    if not ((policy.get("Attempts") or 0) > 0 or policy.get("Unlimited")):
                        continue
                    transition = alloc.get("DesiredTransition") or {}
                    if (
                        alloc["ClientStatus"] == "failed"
                        and not alloc.get("NextAllocation")
                        and not (transition.get("ForceReschedule"))
                    ):
                        updated = {**alloc, "DesiredTransition": {**transition, "ForceReschedule": True}}
                        self.store.upsert_alloc(updated, "AllocationUpdateDesiredStatus")
            evaluation = new_eval(job, "job-register", now, JobModifyIndex=job["ModifyIndex"])
            self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": job["ModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def scale_status(self, ns: str, job_id: str) -> Json:
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(404, "job not found")
        allocs = self.store.allocs_for_job(ns, job_id)
        events = self.store.scaling_events.get((ns, job_id), [])
        groups: Json = {}
        for group in job["TaskGroups"]:
            # `Job.ScaleStatus`: the group's allocations that are not terminal, health as their
            # DeploymentStatus says (set with or without a deployment), canaries left out.
            mine = [
                a
                for a in allocs
                if a["TaskGroup"] == group["Name"]
                and a["DesiredStatus"] == "run"
                and a["ClientStatus"] not in TERMINAL_CLIENT
                and not (a.get("DeploymentStatus") or {}).get("Canary")
            ]
            health = [(a.get("DeploymentStatus") or {}).get("Healthy") for a in mine]
            group_events = [
                {k: v for k, v in e.items() if k != "Group"} for e in events if e["Group"] == group["Name"]
            ]
            groups[group["Name"]] = {
                "Desired": group["Count"],
                "Placed": len(mine),
                "Running": sum(1 for a in mine if a["ClientStatus"] == "running"),
                "Healthy": sum(1 for h in health if h is True),
                "Unhealthy": sum(1 for h in health if h is False),
                "Events": list(reversed(group_events)) or None,
            }
        return {
            "JobID": job["ID"],
            "Namespace": job["Namespace"],
            "JobCreateIndex": job["CreateIndex"],
            "JobModifyIndex": job["JobModifyIndex"],
            "JobStopped": job["Stop"],
            "TaskGroups": groups,
        }

    def validate(self, body: Any) -> Json:
        if not isinstance(body, dict) or not isinstance(body.get("Job"), dict):
            raise ApiError(400, "Job must be specified")
        errors: list[str]
        try:
            job = canonicalize_job(body["Job"], self.clock.now_ns())
            errors = validate_job(job)
        except JobError as exc:
            errors = [str(exc)]
        return {
            "DriverConfigValidated": True,
            "ValidationErrors": errors or None,
            "Error": multierror_text(errors) if errors else "",
            "Warnings": "",
        }

    # ----- allocations ---------------------------------------------------------------------

    def stop_alloc(self, alloc_id: str) -> Json:
        """`Alloc.Stop`: mark the allocation to migrate and let the scheduler replace it."""
        alloc = self.store.allocs.get(alloc_id)
        if alloc is None:
            raise ApiError(404, "alloc not found")
        job = self.store.jobs.get((alloc["Namespace"], alloc["JobID"])) or alloc["Job"]
        with self.store.batch():
            transition = dict(alloc.get("DesiredTransition") or {})
            transition["Migrate"] = True
            self.store.upsert_alloc({**alloc, "DesiredTransition": transition})
            evaluation = new_eval(job, "alloc-stop", self.clock.now_ns())
            self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return {"EvalID": evaluation["ID"], **write_meta(self.store.index)}

    # ----- jobspecs ---------------------------------------------------------------------------

    def parse_job(self, body: Any) -> Json:
        """`/v1/jobs/parse`: HCL2 to the API's Job, canonicalised only when asked."""
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        text = body.get("JobHCL") or ""
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "Job spec is empty")
        try:
            variables = parse_variables_file(str(body.get("Variables") or ""))
            # Lenient as Nomad's endpoint: its ParseConfig leaves Strict false (job_endpoint.go).
            job = parse_jobspec(text, variables, strict=False)
        except JobspecError as exc:
            message = str(exc)
            if not message.startswith("Failed to parse job"):
                message = f"Failed to parse job: {message}"
            raise ApiError(400, message) from None
        if body.get("Canonicalize"):
            try:
                job = canonicalize_job(job, self.clock.now_ns())
            except JobError as exc:
                raise ApiError(400, f"Failed to parse job: {exc}") from None
        return job
