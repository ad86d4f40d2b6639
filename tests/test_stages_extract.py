"""extract / normalize / langid stages on hand-made documents."""

from __future__ import annotations

import pytest

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.extract import Extract, ExtractParams
from lmforge.corpus.stages.langid import LangId, LangIdParams
from lmforge.corpus.stages.normalize import Normalize, NormalizeParams
from lmforge.corpus.stages.quality import C4Filter, C4Params

ARTICLE = [
    "Tide pools form where the sea retreats twice a day and leaves water trapped among the rocks.",
    "The animals that live there have to survive waves, drying sun and sudden changes of salt and heat.",
    "Sea anemones close into soft knots at low tide so that they keep their water until the sea returns.",
    "Hermit crabs move between empty shells as they grow, and a good shell is often fought over for hours.",
]

PAGE = f"""<!DOCTYPE html>
<html><head><title>Coastal Notes: life in the tide pools</title></head>
<body>
<header><nav><ul>
  <li><a href="/">Home</a></li><li><a href="/about">About us</a></li>
  <li><a href="/shop">Visit our shop</a></li><li><a href="/contact">Contact</a></li>
</ul></nav></header>
<main><article>
  <h1>Life in the tide pools</h1>
  {"".join(f"<p>{p}</p>" for p in ARTICLE)}
</article></main>
<aside><h3>Popular posts</h3><ul><li><a href="/p/1">Ten best beaches</a></li>
  <li><a href="/p/2">Our favourite boots</a></li></ul></aside>
<footer><p>Copyright 2024 Coastal Notes. All rights reserved.</p>
  <a href="/privacy">Privacy settings</a> | <a href="/terms">Legal notice</a></footer>
</body></html>"""


def html_doc(html: str) -> Doc:
    return Doc("page.html", html, "web", meta={"format": "html", "source": "crawl"})


def make_pdf(lines: list[str]) -> bytes:
    """A minimal valid one-page PDF (Helvetica text), with a correct cross-reference table."""
    content = "BT /F1 12 Tf 72 720 Td 16 TL " + " ".join(f"({line}) Tj T*" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        " /Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{off:010d} 00000 n \n".encode() for off in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def pdf_doc(raw: bytes) -> Doc:
    return Doc("paper.pdf", "", "papers", meta={"format": "pdf", "raw": raw})


# ----------------------------------------------------------------------------------------------- extract


def test_html_keeps_article_and_drops_boilerplate():
    out = Extract().process(html_doc(PAGE))
    assert isinstance(out, Doc)
    for paragraph in ARTICLE:
        assert paragraph in out.text
    for boilerplate in (
        "About us",
        "Visit our shop",
        "Ten best beaches",
        "All rights reserved",
        "Legal notice",
    ):
        assert boilerplate not in out.text
    assert out.meta == {"source": "crawl"}  # format (and raw) removed, other meta kept


def test_trafilatura_fallbacks_use_lxml_html_clean():
    import lxml.html.clean

    # lxml >= 5.2 ships lxml.html.clean as a re-export of the separate lxml_html_clean package;
    # trafilatura's jusText fallback imports it, so extraction without `fast` needs it.
    assert lxml.html.clean.Cleaner.__module__.startswith("lxml_html_clean")
    out = Extract(ExtractParams(fast=False, favor_precision=False)).process(html_doc(PAGE))
    assert isinstance(out, Doc) and ARTICLE[0] in out.text


def test_html_failures_are_drops_with_reasons():
    assert Extract().process(html_doc("   \n")) == Drop("extract.html_empty")
    nav_only = (
        "<html><body><nav><ul><li><a href=/>Home</a></li><li><a href=/shop>Shop</a></li></ul></nav>"
        "<footer>Copyright 2024</footer></body></html>"
    )
    assert Extract().process(html_doc(nav_only)) == Drop("extract.no_main_content")
    scripts_only = "<html><head><script>var x = 1;</script></head><body><img src=a.png></body></html>"
    assert Extract().process(html_doc(scripts_only)) == Drop("extract.no_main_content")
    for garbage in ("<<<\x00 not html >>>", "<html><body><p>unclosed <b><i>", "\x00\x01\x02"):
        assert isinstance(Extract().process(html_doc(garbage)), Doc | Drop)  # never raises
    assert Extract().process(Doc("x", "t", "web", meta={"format": "docx"})) == Drop("extract.unknown_format")


# A documentation page as generators write it: the source wrapped at a fixed width, with inline
# markup inside the paragraphs (where trafilatura keeps the source's line breaks).
WRAPPED = """<!DOCTYPE html><html><head><title>Calling a function</title></head><body><main>
<h2>2.1 Calling
a function</h2>
<p><code>libdemo</code> assumes that you have a pointer to the function you wish
to call and that you know the number and <em>types</em> of arguments to pass
it, as well as the return type of the function.</p>
<p>The first thing you must do is create a <code>demo_cif</code> object that
matches the <a href="sig.html">signature</a> of the function you wish to call.  This is a
separate step because it is common to make multiple calls using a
single <code>demo_cif</code>.</p>
<ul>
<li><var>abi</var> is the ABI to use; normally
<code>DEMO_DEFAULT_ABI</code> is what you want.</li>
<li><var>nargs</var> is the number of
arguments.</li>
</ul>
<p>Write to us at:<br>
12 Example Road<br>
Springfield</p>
<pre class="example">int main()
{
  demo_call (&amp;cif, fn,
             &amp;rc, values);
}</pre>
<p>The <code>rvalue</code> must be large enough to hold the result and must be
suitably aligned; it is the <em>caller's</em> responsibility to ensure this.</p>
</main></body></html>"""

WRAPPED_LINES = [
    "2.1 Calling a function",
    "libdemo assumes that you have a pointer to the function you wish to call and that you know the "
    "number and types of arguments to pass it, as well as the return type of the function.",
    "The first thing you must do is create a demo_cif object that matches the signature of the function "
    "you wish to call.  This is a separate step because it is common to make multiple calls using a "
    "single demo_cif.",
    "- abi is the ABI to use; normally DEMO_DEFAULT_ABI is what you want.",
    "- nargs is the number of arguments.",
    "Write to us at:",  # <br> stays a line break
    "12 Example Road",
    "Springfield",
    "int main()",  # <pre> keeps every line and its indentation
    "{",
    "  demo_call (&cif, fn,",
    "             &rc, values);",
    "}",
    "The rvalue must be large enough to hold the result and must be suitably aligned; it is the caller's "
    "responsibility to ensure this.",
]


def test_wrapped_lines_of_a_paragraph_are_joined():
    """A paragraph, heading or list item is one line; <br>, <pre> and block boundaries keep theirs."""
    out = Extract().process(html_doc(WRAPPED))
    assert isinstance(out, Doc)
    lines = [line.rstrip() for line in out.text.splitlines()]
    assert lines[: len(WRAPPED_LINES)] == WRAPPED_LINES, out.text
    # Off, trafilatura's text keeps the source's breaks wherever a paragraph has inline markup
    old = Extract(ExtractParams(join_wrapped_lines=False)).process(html_doc(WRAPPED))
    assert "you wish\nto call" in old.text and "normally\nDEMO_DEFAULT_ABI" in old.text
    assert len(old.text.splitlines()) == len(out.text.splitlines()) + 7  # 2 + 3 + 1 + 1 breaks kept


def test_web_recipe_keeps_the_prose_of_wrapped_documentation():
    """The web recipe's extract -> normalize -> c4 keeps every prose paragraph of the page whole. With
    the old settings (source line breaks kept, C4's terminal-punctuation line rule on) only the lines
    that happened to end a sentence survived: sentence fragments."""
    from pathlib import Path

    from lmforge.corpus.config import load_pipeline_config
    from lmforge.corpus.stages.base import run_doc_stages

    recipe = load_pipeline_config(Path(__file__).parents[1] / "configs" / "data" / "web.toml")
    specs = {spec.name: spec for spec in recipe.stages}
    assert specs["c4"].params["filter_no_terminal_punct"] is False  # as FineWeb, which checks ...
    assert specs["c4"].params["filter_ellipsis_lines"] is False  # ... '...' inside the same rule
    assert specs["extract"].params["join_wrapped_lines"] is True
    prose = [WRAPPED_LINES[i] for i in (1, 2, 3, 4, -1)]

    def kept(extract: ExtractParams, c4: C4Params) -> list[str]:
        [out] = run_doc_stages([Extract(extract), Normalize(), C4Filter(c4)], [html_doc(WRAPPED)])
        assert isinstance(out, Doc)
        return out.text.splitlines()

    now = kept(ExtractParams(**specs["extract"].params), C4Params(**specs["c4"].params))
    assert now == prose  # headings, the address and the code are short lines: C4's 5-word rule
    before = kept(ExtractParams(join_wrapped_lines=False), C4Params())
    assert before == [
        "it, as well as the return type of the function.",
        "DEMO_DEFAULT_ABI is what you want.",
        "- nargs is the number of arguments.",
        "suitably aligned; it is the caller's responsibility to ensure this.",
    ]


def test_join_wrapped_lines_leaves_block_whitespace_code_and_no_break_spaces():
    from lxml import html as lxml_html

    from lmforge.corpus.stages.extract import join_wrapped_lines

    tree = lxml_html.fromstring(
        "<div><p>a\n  b <b>c\nd</b>\n<i>e</i>\n</p>\n<p>f\u00a0\ng</p>"
        "<pre>x\n  y <b>z\n w</b></pre><code>k\nl</code>\n<p>m<br>\nn</p><!-- c -->\n<span>o</span></div>"
    )
    join_wrapped_lines(tree)
    ps = tree.findall("p")
    assert ps[0].text == "a b " and ps[0][0].text == "c d" and ps[0][0].tail == " "  # inline: spaces
    assert ps[0][1].tail == "\n"  # before the end of the paragraph: a block edge, left alone
    assert ps[0].tail == "\n"  # between two paragraphs: left alone
    assert ps[1].text == "f\u00a0 g"  # the run holding the break becomes a space; the no-break space stays
    pre = tree.find("pre")
    assert pre.text == "x\n  y " and pre[0].text == "z\n w"  # inside <pre>: untouched
    assert tree.find("code").text == "k\nl" and tree.find("code").tail == "\n"  # code; then a <p>
    assert ps[2][0].tail == "\nn"  # after <br>: the break is the <br>'s, left as it is
    comment = ps[2].getnext()
    assert comment.tail == " "  # a comment is transparent: between it and an inline <span>


def test_pdf_text_is_extracted():
    lines = ["Hello from a hand made PDF.", "Second line of the page."]
    out = Extract().process(pdf_doc(make_pdf(lines)))
    assert isinstance(out, Doc)
    assert "Hello from a hand made PDF." in out.text and "Second line of the page." in out.text
    assert "raw" not in out.meta and "format" not in out.meta


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pag", "extract.pdf_error"),  # truncated
        (b"this is not a pdf at all", "extract.pdf_error"),
        (b"", "extract.pdf_missing"),
    ],
)
def test_corrupt_pdf_is_dropped_with_reason(raw, reason):
    assert Extract().process(pdf_doc(raw)) == Drop(reason)


def test_pdf_without_text_layer_is_dropped():
    assert Extract().process(pdf_doc(make_pdf([]))) == Drop("extract.pdf_empty")


def test_documents_without_format_pass_through():
    doc = Doc("a.txt", "plain text", "prose")
    assert Extract().process(doc) is doc


# --------------------------------------------------------------------------------------------- normalize


def test_normalize_unicode_forms():
    decomposed = "Cafe\u0301 \ufb01ne \uff21"  # e + combining acute, the fi ligature, full-width A
    out = Normalize().process(Doc("d", decomposed, "prose"))
    assert out.text == "Caf\u00e9 \ufb01ne \uff21"  # NFC composes, keeps compatibility forms
    out = Normalize(NormalizeParams(form="NFKC")).process(Doc("d", decomposed, "prose"))
    assert out.text == "Caf\u00e9 fine A"


def test_normalize_whitespace_and_controls():
    raw = "\ufeff\n\n  def f():\r\n\treturn 1   \r\n\r\n\r\n\r\nnext\x00 li\x07ne\u2028last\x0c \n\n"
    out = Normalize().process(Doc("d", raw, "code"))
    assert out.text == "  def f():\n\treturn 1\n\nnext line\nlast"
    out = Normalize(NormalizeParams(max_blank_lines=0)).process(Doc("d", raw, "code"))
    assert out.text == "  def f():\n\treturn 1\nnext line\nlast"


def test_normalize_drops_empty_and_keeps_clean_docs_identical():
    assert Normalize().process(Doc("d", " \n\x00\t\n", "prose")) == Drop("normalize.empty")
    clean = Doc("d", "Already clean.\n\nTwo paragraphs.", "prose")
    assert Normalize().process(clean) is clean


# ------------------------------------------------------------------------------------------------ langid

SENTENCES = {
    "en": "The committee will publish its annual report on the state of the rivers next week.",
    "fr": "Le comité publiera la semaine prochaine son rapport annuel sur l'état des rivières.",
    "de": "Der Ausschuss veröffentlicht nächste Woche seinen Jahresbericht über den Zustand der Flüsse.",
    "es": "El comité publicará la próxima semana su informe anual sobre el estado de los ríos del país.",
    "ru": "Комитет опубликует на следующей неделе свой ежегодный доклад о состоянии рек.",
}


def test_langid_identifies_and_keeps_configured_languages():
    stage = LangId()
    kept = {}
    for lang, text in SENTENCES.items():
        out = stage.process(Doc(lang, text, "prose"))
        kept[lang] = isinstance(out, Doc)
        if isinstance(out, Doc):
            assert out.meta["language"] == "en" and out.meta["language_score"] >= 0.65
        else:  # the detected language is the value, the languages kept the threshold
            assert out == Drop("langid.language", value=lang, threshold=("en",))
    assert kept == {"en": True, "fr": False, "de": False, "es": False, "ru": False}

    multi = LangId(LangIdParams(languages=["fr", "de", "es", "ru"], min_score=0.5))
    for lang, text in SENTENCES.items():
        out = multi.process(Doc(lang, text, "prose"))
        if lang == "en":
            assert out == Drop("langid.language", value="en", threshold=("fr", "de", "es", "ru"))
        else:
            assert isinstance(out, Doc) and out.meta["language"] == lang, (lang, out)


def test_langid_score_threshold():
    strict = LangId(LangIdParams(min_score=1.0))
    assert strict.process(Doc("x", "Hello there", "prose")).reason in ("langid.low_score", "langid.language")
    out = strict.process(Doc("x", SENTENCES["en"], "prose"))
    assert out.reason == "langid.low_score" and out.threshold == 1.0
    kept = LangId().process(Doc("x", SENTENCES["en"], "prose"))
    assert 0.65 < out.value < 1.0 and round(out.value, 4) == kept.meta["language_score"]
