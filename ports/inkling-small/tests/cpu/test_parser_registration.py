"""Registration of `inkling_py` with vLLM 0.30.0's real parser managers (pristine sdist, CPU),
in fresh processes: through `inkling_hpu.parsers.register()` (what the plugin calls) and
through `--tool-parser-plugin <file>` (vLLM's plugin loader, by file path). Also checks the
parsers are self-contained: no `vllm.parser.engine`, no compiled extension."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tools import parser_cases as pc

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PLUGIN_FILE = pc.PORT_ROOT / "inkling_hpu" / "parsers" / "inkling_py.py"


def run(code: str, with_port: bool) -> dict:
    path = [str(pc.VLLM_TREE)] + ([str(pc.PORT_ROOT)] if with_port else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=500, cwd=str(pc.PORT_ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHECK = """
    import json, sys
    from vllm.tool_parsers import ToolParserManager
    from vllm.reasoning import ReasoningParserManager
    before = "inkling_py" in ToolParserManager.list_registered()
    {register}
    tool = ToolParserManager.get_tool_parser("inkling_py")
    reasoning = ReasoningParserManager.get_reasoning_parser("inkling_py")

    class Tok:  # the markers as special tokens; other text is one token per character
        ids = {{"<|content_invoke_tool_json|>": 200049, "<|end_message|>": 200010}}
        all_special_tokens = list(ids)
        all_special_ids = list(ids.values())
        def get_vocab(self): return dict(self.ids)
        def decode(self, ids): return "".join(chr(i) for i in ids)

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    request = ChatCompletionRequest(model="m", messages=[{{"role": "user", "content": "hi"}}])
    info = tool(Tok()).extract_tool_calls(
        '<|content_invoke_tool_json|>{{"name":"f","args":{{"a":1}}}}<|end_message|>', request)
    print(json.dumps({{
        "before": before,
        "tool": tool.__module__ + "." + tool.__qualname__,
        "reasoning": reasoning.__module__ + "." + reasoning.__qualname__,
        "tool_base": [c.__module__ + "." + c.__name__ for c in tool.__mro__],
        "reasoning_base": [c.__module__ + "." + c.__name__ for c in reasoning.__mro__],
        "call": [info.tool_calls[0].function.name, info.tool_calls[0].function.arguments],
        "engine_loaded": sorted(m for m in sys.modules if m.startswith("vllm.parser")),
        "compiled": sorted(m for m in sys.modules if m.startswith("vllm.") and
                           (getattr(sys.modules[m], "__file__", "") or "").endswith((".so", ".pyd"))),
    }}))
"""


def test_register_function_with_vllm_managers():
    out = run(CHECK.format(register="import inkling_hpu.parsers as p; p.register()"), True)
    assert out["before"] is False
    assert out["tool"] == "inkling_hpu.parsers.inkling_py.InklingPyToolParser"
    assert out["reasoning"] == "inkling_hpu.parsers.inkling_py.InklingPyReasoningParser"
    assert "vllm.tool_parsers.abstract_tool_parser.ToolParser" in out["tool_base"]
    assert "vllm.reasoning.abs_reasoning_parsers.ReasoningParser" in out["reasoning_base"]
    assert out["call"] == ["f", '{"a":1}']
    assert not [m for m in out["engine_loaded"] if m.startswith("vllm.parser.engine")]
    assert "vllm.parser.inkling" not in out["engine_loaded"]
    assert out["compiled"] == []


def test_tool_parser_plugin_file_path():
    """`--tool-parser-plugin /path/to/inkling_py.py`: vLLM imports the file by path; the
    module registers itself (the port is not on sys.path here)."""
    register = f"ToolParserManager.import_tool_parser({str(PLUGIN_FILE)!r})"
    out = run(CHECK.format(register=register), False)
    assert out["before"] is False
    assert out["tool"] == "inkling_py.InklingPyToolParser"
    assert out["reasoning"] == "inkling_py.InklingPyReasoningParser"
    assert out["call"] == ["f", '{"a":1}']
    assert not [m for m in out["engine_loaded"] if m.startswith("vllm.parser.engine")]


def test_in_process_registration_resolves_to_ours():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from inkling_hpu.parsers.inkling_py import InklingPyReasoningParser, InklingPyToolParser

    pc.inkling_hpu.parsers.register()
    assert ToolParserManager.get_tool_parser("inkling_py") is InklingPyToolParser
    assert ReasoningParserManager.get_reasoning_parser("inkling_py") is InklingPyReasoningParser
    assert InklingPyToolParser.supports_required_and_named is False
    assert InklingPyToolParser.engine_based_streaming and InklingPyReasoningParser.engine_based_streaming
