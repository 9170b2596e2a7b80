"""The names `--rm-type` (and a sample's `metadata.rm_type`) may take, and why a name is refused.
No imports of the project: the configuration checks `--rm-type` with it before anything starts."""

from __future__ import annotations

TASK_REWARDS = {
    "reverse-digits": "services.tasks.reverse_digits.reward",
    "copy-digits": "services.tasks.copy_digits.reward",
    "reverse-longtail": "services.tasks.reverse_longtail.reward",
    "calculator": "services.tasks.calculator.reward",
    "env": "services.envs.trajectory.env_reward",
}
"""The bundled tasks' own rewards (module.function)."""
GRADED = ("math", "dapo", "deepscaler", "f1", "gpqa", "reasoning_gym", "ifbench")
"""Graded in a worker process by services/rewards/graders.py; each also as `boxed_<name>`."""
HUB = ("remote_rm", "random", *GRADED)
"""Miles's reward hub (rm_hub), with `remote_rm` needing --rm-url."""


def split_rm_type(name: str) -> tuple[bool, str]:
    """(boxed, base): `boxed_math` -> (True, "math")."""
    name = name.strip()
    return (True, name[len("boxed_"):]) if name.startswith("boxed_") else (False, name)


def rm_type_problem(name: str, has_url: bool = True) -> str | None:
    """Why `name` cannot score a sample, or None."""
    boxed, base = split_rm_type(name)
    if base in TASK_REWARDS and not boxed:
        return None
    if base not in HUB:
        known = [*TASK_REWARDS, *HUB, *(f"boxed_{g}" for g in (*GRADED, "remote_rm", "random"))]
        return f"rm_type {name!r} is unknown: use one of {', '.join(known)}, or --custom-rm-path"
    if base == "remote_rm" and not has_url:
        return f"rm_type {name!r} needs --rm-url: the reward model's URL"
    return None


TASK_RM_TYPE = {"reasoning-gym": "reasoning_gym"}
"""Tasks whose reward is a hub type (the others' is their own function, TASK_REWARDS)."""


def row_rm_type_check(has_url: bool):
    """A dataset row check (datasource.load_rows): the rm_type its metadata names, if any, can score."""

    def check(row: dict) -> str | None:
        name = (row.get("metadata") or {}).get("rm_type")
        if name is None:
            return None
        if not isinstance(name, str):
            return f"metadata.rm_type {name!r:.60} is not a name"
        problem = rm_type_problem(name, has_url)
        return None if problem is None else f"metadata.{problem}"

    return check
