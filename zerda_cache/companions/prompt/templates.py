# ruff: noqa: RUF001, RUF002 - Turkish text: its dotless i is a letter, not a confusable
"""Bilingual (English and Turkish) texts for guardrails and output formats.

Each text is written natively in its language, not translated word by word. The Turkish
texts address the model with the informal imperative ("yanıtla", "uydurma"), the usual
register of Turkish instructions. The citation marker stays ``[Source: N]`` in both
languages: it is a machine-readable marker that ``ContextGuard``'s source check recognises.

``OutputFormat.TEXT`` has no format instruction, in either language (as in the seed).
"""

from __future__ import annotations

from collections.abc import Mapping

from zerda_cache.companions.prompt.types import OutputFormat

DEFAULT_LANGUAGE = "en"
SUPPORTED_LANGUAGES = ("en", "tr")

_HEADERS: Mapping[str, str] = {
    "en": "Follow these rules in your answer:",
    "tr": "Yanıtında şu kurallara uy:",
}

_SCHEMA_LABELS: Mapping[str, str] = {"en": "Schema:", "tr": "Şema:"}

_GUARDRAIL_TEXTS: Mapping[str, Mapping[str, str]] = {
    "en": {
        "safe_output": (
            "Do not produce harmful, hateful, illegal or sexually explicit content; if asked "
            "for it, decline briefly and say why."
        ),
        "pii_protection": (
            "Do not reveal personal data such as home addresses, phone numbers, email "
            "addresses, or ID and account numbers; mask any that appear in the documents."
        ),
        "grounding": "Base your answer only on the documents provided, not on outside knowledge.",
        "no_fabrication": (
            "Never make up facts, figures, names, quotes or references; if the documents do "
            "not contain the answer, say so."
        ),
        "cite_sources": (
            "Cite the document behind each claim as [Source: N], where N is its number."
        ),
        "uncertainty": (
            "When you are unsure or the evidence is incomplete, say so plainly and state how "
            "confident you are."
        ),
        "stay_on_topic": "Keep to the question asked; do not wander into unrelated topics.",
        "self_check": (
            "Before you answer, check your answer for errors, contradictions and gaps, and "
            "fix them."
        ),
        "show_reasoning": (
            "Work through the problem step by step, then give the final answer on its own, "
            "clearly marked."
        ),
        "concise": "Be concise: answer directly, without filler or repetition.",
        "no_markdown_leakage": (
            "Write plain text: no Markdown syntax such as #, **, backticks or tables."
        ),
    },
    "tr": {
        "safe_output": (
            "Zararlı, nefret söylemi içeren, yasa dışı ya da müstehcen içerik üretme; böyle "
            "bir istekle karşılaşırsan kısaca reddet ve nedenini söyle."
        ),
        "pii_protection": (
            "Ev adresi, telefon numarası, e-posta adresi, kimlik ya da hesap numarası gibi "
            "kişisel verileri paylaşma; belgelerde geçenleri maskele."
        ),
        "grounding": "Yanıtını yalnızca sana verilen belgelere dayandır; dışarıdan bilgi katma.",
        "no_fabrication": (
            "Olgu, rakam, isim, alıntı ya da kaynak asla uydurma; yanıt belgelerde yoksa "
            "bunu açıkça söyle."
        ),
        "cite_sources": (
            "Her bilginin hangi belgeden geldiğini [Source: N] biçiminde göster; N, belgenin "
            "numarasıdır."
        ),
        "uncertainty": (
            "Emin olmadığın ya da kanıtın yetersiz kaldığı yerde bunu açıkça söyle ve ne "
            "kadar emin olduğunu belirt."
        ),
        "stay_on_topic": "Sorulan sorunun dışına çıkma; konuyla ilgisi olmayan yerlere dalma.",
        "self_check": (
            "Yanıtını vermeden önce hata, çelişki ya da eksik var mı diye gözden geçir ve "
            "bulduklarını düzelt."
        ),
        "show_reasoning": (
            "Sorunu adım adım çöz, ardından nihai yanıtını ayrıca ve açıkça belirterek ver."
        ),
        "concise": "Kısa ve öz ol: lafı dolandırmadan, tekrara düşmeden yanıtla.",
        "no_markdown_leakage": (
            "Düz metin yaz: #, **, ters tırnak ya da tablo gibi Markdown öğeleri kullanma."
        ),
    },
}

_FORMAT_TEXTS: Mapping[str, Mapping[OutputFormat, str]] = {
    "en": {
        OutputFormat.JSON: (
            "Reply with a single valid JSON value and nothing else: no text before or after it."
        ),
        OutputFormat.MARKDOWN: (
            "Format your answer in Markdown, using headings and lists where they help."
        ),
        OutputFormat.STRUCTURED: (
            "Reply with a single JSON object with clearly named fields and nothing outside "
            "it; if a schema is given, follow it exactly."
        ),
        OutputFormat.BULLETS: "Answer as a bulleted list, one point per bullet.",
    },
    "tr": {
        OutputFormat.JSON: (
            "Yalnızca geçerli tek bir JSON değeriyle yanıt ver; öncesine ya da sonrasına "
            "hiçbir metin ekleme."
        ),
        OutputFormat.MARKDOWN: (
            "Yanıtını Markdown ile biçimlendir; işe yarayacak yerlerde başlık ve liste kullan."
        ),
        OutputFormat.STRUCTURED: (
            "Alanları açıkça adlandırılmış tek bir JSON nesnesiyle yanıt ver ve dışına bir "
            "şey yazma; şema verildiyse ona harfiyen uy."
        ),
        OutputFormat.BULLETS: "Yanıtını madde madde yaz; her maddede tek bir fikir olsun.",
    },
}


def resolve_lang(language: str | None) -> str:
    """The template language for a request's ``language``.

    Args:
        language: e.g. ``"en"``, ``"tr"``, ``"TR"`` or ``"tr-TR"`` (case and a region suffix
            are ignored).

    Returns:
        ``"en"`` or ``"tr"``; anything unsupported (or ``None``) gives ``"en"``.
    """
    if not isinstance(language, str):
        return DEFAULT_LANGUAGE
    base = language.strip().lower().replace("_", "-").split("-", 1)[0]
    return base if base in SUPPORTED_LANGUAGES else DEFAULT_LANGUAGE


def guardrail_header(lang: str) -> str:
    """The line that introduces the numbered guardrail list, in ``lang`` (resolved with
    :func:`resolve_lang`, as every ``lang`` below)."""
    return _HEADERS[resolve_lang(lang)]


def guardrail_text(name: str, lang: str, fallback: str) -> str:
    """A guardrail's instruction in ``lang``.

    Args:
        name: the guardrail's name (e.g. ``"grounding"``).
        lang: a language.
        fallback: returned when there is no native text for this name and language
            (e.g. a custom guardrail's own ``instruction``).

    Returns:
        The native text, or ``fallback``.
    """
    return _GUARDRAIL_TEXTS[resolve_lang(lang)].get(name, fallback)


def format_instruction_text(fmt: OutputFormat, lang: str) -> str | None:
    """The instruction for the output format ``fmt`` in ``lang``; ``None`` for a format
    without one (always ``OutputFormat.TEXT``)."""
    return _FORMAT_TEXTS[resolve_lang(lang)].get(fmt)


def schema_label(lang: str) -> str:
    """The label before a rendered output schema in ``lang`` (``"Schema:"`` in English)."""
    return _SCHEMA_LABELS[resolve_lang(lang)]


def localized_guardrail_names(lang: str) -> frozenset[str]:
    """The guardrail names with a native text in ``lang`` (for tests and documentation)."""
    return frozenset(_GUARDRAIL_TEXTS[resolve_lang(lang)])


__all__ = [
    "DEFAULT_LANGUAGE",
    "SUPPORTED_LANGUAGES",
    "format_instruction_text",
    "guardrail_header",
    "guardrail_text",
    "localized_guardrail_names",
    "resolve_lang",
    "schema_label",
]
