"""A verifiers Toolset for tests/service/test_env_verifiers.py. verifiers serves a task's toolset
as an MCP server in a process of its own, `python -m <this module>`."""

from __future__ import annotations

import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
    """Its tools reach the model as calc_<name>."""

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """The sum of two integers."""
        return str(a + b)


if __name__ == "__main__":
    Calc.run()
