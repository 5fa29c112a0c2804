"""Tool-call parsers: well-formed calls, and malformed ones turned into messages for the model."""

from rolloutd.daemon.llm.parsers import (
    error_observation,
    get_parser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)


def test_hermes_single_and_multiple_calls():
    t = parse_hermes('Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in t.calls] == [("bash", {"cmd": "ls"})]
    assert t.content == "Let me look." and not t.errors
    t = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert [c.name for c in t.calls] == ["a", "b"]


def test_hermes_plain_answer_has_no_tool_activity():
    t = parse_hermes("The answer is 4.")
    assert t.content == "The answer is 4." and not t.has_tool_activity


def test_hermes_arguments_as_json_string_and_parameters_key():
    t = parse_hermes('<tool_call>{"name": "bash", "arguments": "{\\"cmd\\": \\"pwd\\"}"}</tool_call>')
    assert t.calls[0].arguments == {"cmd": "pwd"}
    t = parse_hermes('<tool_call>{"name": "bash", "parameters": {"cmd": "pwd"}}</tool_call>')
    assert t.calls[0].arguments == {"cmd": "pwd"}


def test_hermes_malformed_calls_become_errors():
    bad_json = parse_hermes('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}</tool_call>')
    assert not bad_json.calls and "not valid JSON" in bad_json.errors[0].message
    unclosed = parse_hermes('<tool_call>{"name": "bash", "arguments": {}}')
    assert "not closed" in unclosed.errors[0].message
    no_name = parse_hermes('<tool_call>{"arguments": {}}</tool_call>')
    assert '"name"' in no_name.errors[0].message
    bad_args = parse_hermes('<tool_call>{"name": "x", "arguments": [1, 2]}</tool_call>')
    assert "must be a JSON object" in bad_args.errors[0].message
    not_obj = parse_hermes("<tool_call>[1]</tool_call>")
    assert "JSON object" in not_obj.errors[0].message
    stray = parse_hermes('oops </tool_call>')
    assert "without <tool_call>" in stray.errors[0].message
    # one good and one bad call: the good one still runs, the bad one is reported
    mixed = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>')
    assert [c.name for c in mixed.calls] == ["a"] and len(mixed.errors) == 1
    note = error_observation(mixed.errors)
    assert note.startswith("Error: tool call 1 could not be used:") and "<tool_call>" in note


def test_mistral_format():
    t = parse_mistral('[TOOL_CALLS] [{"name": "bash", "arguments": {"cmd": "ls"}}, {"name": "finish", "arguments": {"answer": "4"}}]')
    assert [c.name for c in t.calls] == ["bash", "finish"]
    assert parse_mistral("no calls here").content == "no calls here"
    assert "not valid JSON" in parse_mistral("[TOOL_CALLS] [{oops").errors[0].message


def test_llama3_json_format():
    t = parse_llama3_json('<|python_tag|>{"name": "bash", "parameters": {"cmd": "ls"}}')
    assert t.calls[0].name == "bash" and t.calls[0].arguments == {"cmd": "ls"}
    assert parse_llama3_json("4").content == "4"
    assert parse_llama3_json('{"answer": 4}').content == '{"answer": 4}'  # JSON, but not a call
    assert parse_llama3_json('{"name": "bash", "parameters": ').errors


def test_get_parser_names():
    assert get_parser("hermes") is parse_hermes
    try:
        get_parser("nope")
    except ValueError as exc:
        assert "hermes" in str(exc)
