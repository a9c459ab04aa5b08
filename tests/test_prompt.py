"""The prompt companion modules (seed page ``prompt-guardrails``) and ``prompt_scope``.

One test per numbered step of ``GuardrailEngine.build``, of ``_select``'s rules and of
``_render``, each of the page's examples, the bilingual templates, and the scope digest.
"""

from __future__ import annotations

import logging
import re

import pytest

from zerda_cache.companions.prompt import (
    Guardrail,
    GuardrailEngine,
    GuardrailLibrary,
    OutputFormat,
    PromptRequest,
    PromptStrategy,
    PromptType,
    QueryComplexity,
    format_instruction_text,
    guardrail_header,
    guardrail_text,
    prompt_scope,
    resolve_lang,
)
from zerda_cache.companions.prompt import guardrails as guardrails_module
from zerda_cache.companions.prompt.templates import localized_guardrail_names

BUILT_IN_NAMES = [
    "safe_output",
    "pii_protection",
    "grounding",
    "no_fabrication",
    "cite_sources",
    "uncertainty",
    "stay_on_topic",
    "self_check",
    "show_reasoning",
    "concise",
    "no_markdown_leakage",
]
GATED = {"grounding", "no_fabrication", "uncertainty", "cite_sources", "stay_on_topic"}
GATED |= {"pii_protection"}
DOCS = ["Redis is an in-memory store.", "RAG retrieves documents first."]


def names(request: PromptRequest, engine: GuardrailEngine | None = None) -> list[str]:
    return (engine or GuardrailEngine()).build(request)[1]


def selected(request: PromptRequest) -> list[str]:
    return [g.name for g in GuardrailEngine()._select(request)]


# -- library ----------------------------------------------------------------------------------


def test_library_priorities() -> None:
    lib = GuardrailLibrary.all()
    assert [g.name for g in lib] == BUILT_IN_NAMES
    assert GuardrailLibrary.SAFE_OUTPUT.priority == 110
    assert GuardrailLibrary.NO_MARKDOWN_LEAKAGE.priority == 30
    for g in lib[1:-1]:
        assert 30 < g.priority < 110, g
    assert len({g.priority for g in lib}) == len(lib)  # a total order
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", g.name) for g in lib)
    assert Guardrail("x", "y").priority == 50


def test_no_markdown_leakage_is_never_selected_automatically() -> None:
    for fmt in OutputFormat:
        request = PromptRequest(
            query="q",
            documents=DOCS,
            enable_uncertainty=True,
            enable_citations=True,
            strategy=PromptStrategy.CHAIN_OF_THOUGHT,
            complexity=QueryComplexity.EXPERT,
            output_format=fmt,
        )
        assert names(request) == [n for n in BUILT_IN_NAMES if n != "no_markdown_leakage"]


# -- _select: one test per rule ---------------------------------------------------------------


def test_select_rule1_safe_output_and_concise_always_on() -> None:
    for enabled in (True, False):
        chosen = selected(PromptRequest(query="q", enable_guardrails=enabled))
        assert chosen[:2] == ["safe_output", "concise"]
    assert selected(PromptRequest(query="q", enable_guardrails=False)) == [
        "safe_output",
        "concise",
    ]


def test_select_rule2_gated_by_enable_guardrails() -> None:
    full = PromptRequest(query="q", documents=DOCS, enable_uncertainty=True, enable_citations=True)
    assert selected(full) == [
        "safe_output",
        "concise",
        "grounding",
        "no_fabrication",
        "uncertainty",
        "cite_sources",
        "stay_on_topic",
        "pii_protection",
    ]
    full.enable_guardrails = False
    assert not GATED & set(selected(full))
    # Citations need documents; no documents, no grounding either.
    no_docs = PromptRequest(query="q", enable_citations=True)
    assert not {"cite_sources", "grounding", "no_fabrication"} & set(selected(no_docs))
    # Agents and tool use get no STAY_ON_TOPIC; PII_PROTECTION still applies.
    for prompt_type in PromptType:
        chosen = selected(PromptRequest(query="q", prompt_type=prompt_type))
        open_ended = prompt_type in (PromptType.AGENT, PromptType.TOOL_USE)
        assert ("stay_on_topic" in chosen) is not open_ended
        assert "pii_protection" in chosen


def test_select_rule3_strategy_adds_show_reasoning_regardless() -> None:
    reasoning = {
        PromptStrategy.CHAIN_OF_THOUGHT,
        PromptStrategy.MULTI_HOP,
        PromptStrategy.LEAST_TO_MOST,
    }
    for strategy in PromptStrategy:
        for enabled in (True, False):
            request = PromptRequest(query="q", strategy=strategy, enable_guardrails=enabled)
            assert ("show_reasoning" in selected(request)) is (strategy in reasoning)


def test_select_rule4_complexity_adds_self_check_regardless() -> None:
    for complexity in QueryComplexity:
        for enabled in (True, False):
            request = PromptRequest(query="q", complexity=complexity, enable_guardrails=enabled)
            hard = complexity in (QueryComplexity.COMPLEX, QueryComplexity.EXPERT)
            assert ("self_check" in selected(request)) is hard


# -- build: one test per workflow step --------------------------------------------------------


def test_build_step1_starts_from_select(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = GuardrailEngine()
    custom = Guardrail("only_this", "Only this.", 10)
    monkeypatch.setattr(engine, "_select", lambda req: [custom])
    assert engine.build(PromptRequest(query="q"))[1] == ["only_this"]


def test_build_step2_extras_always_appended() -> None:
    extra = Guardrail("house_style", "Use British spelling.", 45)
    engine = GuardrailEngine(extra_guardrails=[extra])
    assert "house_style" in names(PromptRequest(query="q", enable_guardrails=False), engine)
    assert names(PromptRequest(query="q", enable_guardrails=False), engine) == [
        "safe_output",
        "house_style",
        "concise",
    ]


def test_build_step3_sorted_by_descending_priority() -> None:
    low = Guardrail("lowest", "Low.", 1)
    high = Guardrail("highest", "High.", 1000)
    engine = GuardrailEngine(extra_guardrails=[low, high])
    request = PromptRequest(query="q", documents=DOCS, strategy=PromptStrategy.MULTI_HOP)
    applied = names(request, engine)
    assert applied[0] == "highest" and applied[-1] == "lowest"
    priorities = {g.name: g.priority for g in [*GuardrailLibrary.all(), low, high]}
    assert [priorities[n] for n in applied] == sorted(
        (priorities[n] for n in applied), reverse=True
    )


def test_build_step4_dedup_by_name_keeps_first_after_stable_sort() -> None:
    # Same name, higher priority: that instance's position wins.
    boosted = Guardrail("concise", "Be brief.", 200)
    applied = names(PromptRequest(query="q"), GuardrailEngine(extra_guardrails=[boosted]))
    assert applied.count("concise") == 1 and applied[0] == "concise"
    # Same name, same priority: the stable sort keeps the earlier (built-in) one.
    twin = Guardrail("concise", "A custom twin.", GuardrailLibrary.CONCISE.priority)
    block, applied = GuardrailEngine(extra_guardrails=[twin, twin]).build(
        PromptRequest(query="q", enable_guardrails=False)
    )
    assert applied == ["safe_output", "concise"]
    assert "A custom twin." not in block


def test_build_step5_renders_the_unique_list() -> None:
    block, applied = GuardrailEngine().build(PromptRequest(query="q", documents=DOCS))
    numbered = re.findall(r"^(\d+)\. ", block, re.M)
    assert numbered == [str(i) for i in range(1, len(applied) + 1)]


def test_build_step6_returns_block_and_names_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="zerda_cache.companions.prompt.guardrails"):
        block, applied = GuardrailEngine().build(PromptRequest(query="q"))
    assert isinstance(block, str) and block
    assert applied == ["safe_output", "pii_protection", "stay_on_topic", "concise"]
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.DEBUG
    assert "safe_output" in caplog.records[0].getMessage()


# -- _render: one test per step ---------------------------------------------------------------


def test_render_step1_resolves_language() -> None:
    for language, resolved in (("tr", "tr"), ("TR-tr", "tr"), ("de", "en"), ("en", "en")):
        block, _ = GuardrailEngine().build(PromptRequest(query="q", language=language))
        assert block.startswith(guardrail_header(resolved) + "\n1. ")
    assert guardrail_header("tr").startswith("Yan")


def test_render_step2_header_and_numbered_list_with_fallback() -> None:
    custom = Guardrail("no_legal_advice", "Do not give legal advice.", 85)
    engine = GuardrailEngine(extra_guardrails=[custom])
    for lang in ("en", "tr"):
        request = PromptRequest(query="q", enable_guardrails=False, language=lang)
        block, applied = engine.build(request)
        lines = block.splitlines()
        assert lines[0] == guardrail_header(lang)
        assert lines[1:] == [
            f"{i}. {guardrail_text(name, lang, fallback='Do not give legal advice.')}"
            for i, name in enumerate(applied, start=1)
        ]
        assert lines[2] == "2. Do not give legal advice."  # no native text: the instruction
    tr_block, _ = GuardrailEngine().build(PromptRequest(query="q", language="tr"))
    assert GuardrailLibrary.SAFE_OUTPUT.instruction not in tr_block


def test_render_step2_no_guardrails_no_header(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = GuardrailEngine()
    monkeypatch.setattr(engine, "_select", lambda req: [])
    assert engine.build(PromptRequest(query="q")) == ("", [])
    block, _ = engine.build(PromptRequest(query="q", output_format=OutputFormat.JSON))
    assert block == format_instruction_text(OutputFormat.JSON, "en")


def test_render_step3_format_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = GuardrailEngine()
    base, _ = engine.build(PromptRequest(query="q"))  # TEXT: no format line
    for fmt in OutputFormat:
        for lang in ("en", "tr"):
            request = PromptRequest(query="q", output_format=fmt, language=lang)
            block, _ = engine.build(request)
            text = format_instruction_text(fmt, lang)
            if fmt is OutputFormat.TEXT:
                assert text is None
                assert block == engine.build(PromptRequest(query="q", language=lang))[0]
            else:
                assert text is not None and block.endswith("\n\n" + text)
    assert all(not base.endswith(t) for t in GuardrailEngine._FORMAT_INSTRUCTIONS.values())
    # Templates without a text: the English-only class table is the fallback.
    monkeypatch.setattr(guardrails_module, "format_instruction_text", lambda fmt, lang: None)
    block, _ = engine.build(PromptRequest(query="q", output_format=OutputFormat.BULLETS))
    assert block.endswith(GuardrailEngine._FORMAT_INSTRUCTIONS[OutputFormat.BULLETS])
    assert OutputFormat.TEXT not in GuardrailEngine._FORMAT_INSTRUCTIONS


def test_render_step4_schema_only_with_structured() -> None:
    schema = {"type": "object", "properties": {"total": {"type": "number"}}}
    engine = GuardrailEngine()
    block, _ = engine.build(
        PromptRequest(query="q", output_format=OutputFormat.STRUCTURED, output_schema=schema)
    )
    assert block.endswith('```json\n{\n  "type": "object",\n  "properties": {\n    "total": '
                          '{\n      "type": "number"\n    }\n  }\n}\n```')  # fmt: skip
    assert "\nSchema:\n```json\n" in block
    tr_block, _ = engine.build(
        PromptRequest(
            query="q", output_format=OutputFormat.STRUCTURED, output_schema=schema, language="tr"
        )
    )
    assert "\nŞema:\n```json\n" in tr_block
    for fmt in (OutputFormat.JSON, OutputFormat.TEXT):
        block, _ = engine.build(PromptRequest(query="q", output_format=fmt, output_schema=schema))
        assert "Schema:" not in block and '"total"' not in block
    block, _ = engine.build(PromptRequest(query="q", output_format=OutputFormat.STRUCTURED))
    assert "Schema:" not in block


# -- templates --------------------------------------------------------------------------------


def test_resolve_lang() -> None:
    assert resolve_lang("en") == "en"
    assert resolve_lang("tr") == "tr"
    assert resolve_lang(" TR ") == "tr"
    assert resolve_lang("tr_TR") == "tr"
    for other in ("de", "", "english", "turkish", None):
        assert resolve_lang(other) == "en"


def test_every_built_in_has_native_english_and_turkish_text() -> None:
    for lang in ("en", "tr"):
        assert localized_guardrail_names(lang) == set(BUILT_IN_NAMES)
    for name in BUILT_IN_NAMES:
        en = guardrail_text(name, "en", fallback="")
        tr = guardrail_text(name, "tr", fallback="")
        assert en and tr and en != tr
    assert guardrail_text("unknown", "tr", fallback="fb") == "fb"
    assert guardrail_header("en") != guardrail_header("tr")
    # The citation marker is the one ContextGuard's source check recognises, in both.
    assert "[Source: N]" in guardrail_text("cite_sources", "tr", fallback="")


def test_every_format_but_text_has_both_languages() -> None:
    for fmt in OutputFormat:
        en, tr = format_instruction_text(fmt, "en"), format_instruction_text(fmt, "tr")
        if fmt is OutputFormat.TEXT:
            assert en is None and tr is None
        else:
            assert en and tr and en != tr
    assert format_instruction_text(OutputFormat.JSON, "fr") == format_instruction_text(
        OutputFormat.JSON, "en"
    )


# -- the page's examples -----------------------------------------------------------------------


def test_example1_basic() -> None:
    engine = GuardrailEngine()
    block, applied = engine.build(PromptRequest(query="What is RAG?"))
    # The page prints ['safe_output', 'concise'] "(no docs -> no grounding-related
    # guardrails)", but its own selection rules also add STAY_ON_TOPIC and PII_PROTECTION
    # when enable_guardrails is on (the default). We follow the rules; the point of the
    # example, no grounding-related guardrails without documents, holds.
    assert applied == ["safe_output", "pii_protection", "stay_on_topic", "concise"]
    assert not {"grounding", "no_fabrication", "cite_sources"} & set(applied)
    assert block.startswith(guardrail_header("en"))
    assert names(PromptRequest(query="What is RAG?", enable_guardrails=False)) == [
        "safe_output",
        "concise",
    ]


def test_example2_documents_and_citations() -> None:
    doc1, doc2 = DOCS
    req = PromptRequest(query="...", documents=[doc1, doc2], enable_citations=True)
    block, applied = GuardrailEngine().build(req)
    assert {"grounding", "no_fabrication", "cite_sources", "pii_protection", "stay_on_topic"} <= (
        set(applied)
    )
    assert "[Source: N]" in block


def test_example3_custom_extra_guardrail() -> None:
    no_legal_advice = Guardrail(
        name="no_legal_advice",
        instruction="Do not provide legal advice; recommend consulting a licensed attorney.",
        priority=85,
    )
    engine = GuardrailEngine(extra_guardrails=[no_legal_advice])
    req = PromptRequest(query="Can I break my lease?", documents=DOCS, enable_uncertainty=True)
    block, applied = engine.build(req)
    assert applied.index("no_legal_advice") == applied.index("uncertainty") - 1  # 85 > 80
    assert "recommend consulting a licensed attorney" in block


def test_example4_little_to_fail() -> None:
    request = PromptRequest(query="", documents=[], output_schema=None, language="")
    block, applied = GuardrailEngine().build(request)
    assert applied and block


def test_example5_structured_output_with_schema() -> None:
    invoice_doc = "Invoice 42: 3 x widget at 9.99"
    req = PromptRequest(
        query="Extract line items from this invoice.",
        documents=[invoice_doc],
        output_format=OutputFormat.STRUCTURED,
        output_schema={"type": "object", "properties": {"line_items": {"type": "array"}}},
    )
    block, applied = GuardrailEngine().build(req)
    assert "Schema:" in block
    assert {"grounding", "no_fabrication"} <= set(applied)
    assert '"line_items"' in block


# -- prompt_scope -----------------------------------------------------------------------------


def test_scope_is_stable_and_short() -> None:
    request = PromptRequest(query="What is RAG?", documents=DOCS)
    scope = prompt_scope(request)
    assert scope == prompt_scope(PromptRequest(query="What is RAG?", documents=list(DOCS)))
    assert re.fullmatch(r"p1:[0-9a-f]{24}", scope)
    assert len(scope) <= 256


def test_same_question_two_guardrail_sets_two_scopes() -> None:
    plain = PromptRequest(query="What is RAG?")
    guarded = PromptRequest(query="What is RAG?", documents=DOCS, enable_citations=True)
    assert names(plain) != names(guarded)
    assert prompt_scope(plain) != prompt_scope(guarded)
    extra = GuardrailEngine(extra_guardrails=[Guardrail("no_legal_advice", "No advice.", 85)])
    assert prompt_scope(plain, extra) != prompt_scope(plain)


def test_scope_ignores_what_does_not_change_instructions() -> None:
    # The query text itself and the documents' content are not part of the scope.
    a = PromptRequest(query="What is RAG?", documents=["one"])
    b = PromptRequest(query="Explain RAG", documents=["two", "three"])
    assert prompt_scope(a) == prompt_scope(b)
    # Languages resolving alike give one scope.
    assert prompt_scope(PromptRequest(query="q", language="de")) == prompt_scope(
        PromptRequest(query="q", language="en")
    )


def test_scope_differs_by_format_language_and_schema() -> None:
    base = PromptRequest(query="q", output_format=OutputFormat.STRUCTURED)
    variants = [
        base,
        PromptRequest(query="q", output_format=OutputFormat.JSON),
        PromptRequest(query="q", output_format=OutputFormat.STRUCTURED, language="tr"),
        PromptRequest(query="q", output_format=OutputFormat.STRUCTURED, output_schema={}),
        PromptRequest(
            query="q", output_format=OutputFormat.STRUCTURED, output_schema={"type": "object"}
        ),
    ]
    scopes = [prompt_scope(v) for v in variants]
    assert len(set(scopes)) == len(scopes)
    # Schema key order does not matter (canonical JSON).
    s1 = {"type": "object", "properties": {"a": {"type": "string"}}}
    s2 = {"properties": {"a": {"type": "string"}}, "type": "object"}
    assert prompt_scope(PromptRequest(query="q", output_schema=s1)) == prompt_scope(
        PromptRequest(query="q", output_schema=s2)
    )


def test_scope_rejects_a_schema_that_is_not_json() -> None:
    with pytest.raises(ValueError, match="output_schema"):
        prompt_scope(PromptRequest(query="q", output_schema={"bad": {1, 2}}))
    with pytest.raises(ValueError, match="output_schema"):
        prompt_scope(PromptRequest(query="q", output_schema={"x": float("nan")}))
