"""Texts that break naive tokenization and offset handling (docs/RELIABILITY.md rows 9-21), shared by
the stage-1 tests of each backend."""

HOSTILE = {
    "rtl": "مرحبا بالعالم: إذا كان س = ٣ فإن س² = ٩. שלום עולם x=1",
    "combining": "e\u0301te\u0301 Z\u0335\u0321a\u0337lgo n\u0303 a\u0308",
    "zwj_emoji": "family 👨\u200d👩\u200d👧\u200d👦 and 🏳\ufe0f\u200d🌈 and 👍🏽 done",
    "bare_cr": "old mac\rline endings\rstill here",
    "crlf": "windows\r\nline\r\n\r\nendings",
    "cjk": "设 x 为实数，求 x² 的最小值。二次関数のグラフ",
    "control_chars": "bell\x07 escape\x1b[31m form\x0cfeed vt\x0b end",
    "bom_and_zero_width": "\ufeffstart\u200bzero\u200cwidth\u2060joiner",
    "private_use_and_noncharacters": "pua \ue000\uf8ff non \ufffe\uffff char",
    "astral_math": "𝔽 𝕊 𝒜 𝟘𝟙 — 𝑥² + 𝑦² = 𝑟²",
}
