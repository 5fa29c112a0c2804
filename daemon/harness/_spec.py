"""``task.agent``: the agent command a harness-driven rollout runs instead of the built-in loop."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

NonBlank = Annotated[str, Field(pattern=r"[^\s\x1c-\x1f]")]
AbsPath = Annotated[str, Field(pattern=r"^/[^,:\x00]*$")]
#: An argument of the command: no NUL (an exec would refuse it), not empty or blank.
Arg = Annotated[str, Field(pattern=r"^[^\x00]*[^\s\x1c-\x1f\x00][^\x00]*$")]
#: An environment variable's name: not empty, no ``=`` or NUL; its value: no NUL.
EnvName = Annotated[str, Field(pattern=r"^[^=\x00]+$")]
EnvValue = Annotated[str, Field(pattern=r"^[^\x00]*$")]


def _keys_are_names(schema: dict[str, Any]) -> None:
    # pydantic writes a dict[EnvName, ...] as patternProperties, which admits other keys too.
    (pattern, value), = schema.pop("patternProperties").items()
    schema.update(propertyNames={"pattern": pattern}, additionalProperties=value)


EnvMap = Annotated[dict[EnvName, EnvValue], Field(json_schema_extra=_keys_are_names)]


class AgentInstall(BaseModel):
    """Install the harness at INIT from a directory of wheels (no index, no network): a venv
    at :data:`AGENT_VENV` inside the sandbox, made by ``python``, whose ``bin`` leads PATH."""

    model_config = ConfigDict(extra="forbid", strict=True)

    wheels: AbsPath = Field(description="A host directory of wheels, shown read-only in the sandbox.")
    packages: list[NonBlank] = Field(min_length=1, description="What to pip install from it.")
    python: NonBlank = Field("python3", description="The sandbox's interpreter that makes the venv.")
    timeout_s: float = Field(600.0, gt=0, le=86_400, description="Deadline of the install.")


class AgentSpec(BaseModel):
    """An agent harness to run in the sandbox (DESIGN section 13)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    command: list[Arg] = Field(
        min_length=1, description="argv, run in the sandbox's working directory. Its environment "
        "has OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (the "
        "rollout's own endpoint and key), ROLLOUTD_TASK_FILE (the task's prompt as text) and "
        "ROLLOUTD_MESSAGES_FILE (the prompt's messages as JSON).")
    env: EnvMap = Field(default_factory=dict, description="More environment variables.")
    timeout_s: float | None = Field(
        None, gt=0, le=86_400, description="Stop the harness after this long and go on to EVAL "
        "(the rollout's own timeout_s still bounds everything).")
    install: AgentInstall | None = None
    model: NonBlank = Field("rolloutd", description="The model name the endpoint reports.")


#: Where ``install`` puts the harness's venv inside the sandbox, and the wheels dir.
AGENT_VENV = "/tmp/rolloutd-agent"
WHEELS_DIR = "/tmp/rolloutd-wheels"
