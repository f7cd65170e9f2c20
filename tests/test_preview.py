"""Link-preview tags: Gradio's are replaced by one set of ours."""

from __future__ import annotations

from rstcnn.serve.preview import TITLE, preview_tags, rewrite

GRADIO_HEAD = b"""<!doctype html>
<html lang="en">
\t<head>
\t\t<meta charset="utf-8" />
\t\t<meta property="og:title" content="Gradio" />
\t\t<meta property="og:url" content="{url}" />
\t\t<meta
\t\t\tproperty="og:image"
\t\t\tcontent="https://example.org/header-image.jpg"
\t\t/>
\t\t<meta name="twitter:creator" content="@Gradio" />
\t\t<meta name="viewport" content="width=device-width" />
\t\t<title>App</title>
\t</head><body>og:title stays in the body</body></html>"""


def test_rewrite_keeps_one_set_of_ours_after_the_charset():
    page = rewrite(GRADIO_HEAD, "http://host:1/?sample=2").decode()
    head = page[: page.index("</head>")]
    assert page.index('<meta charset="utf-8" />') < page.index('property="og:title"')
    assert head.count("og:title") == 1 and f'content="{TITLE}"' in head
    assert 'content="http://host:1/?sample=2"' in head
    for gone in ("Gradio", "{url}", "example.org", "og:image"):
        assert gone not in head, gone
    assert '<meta name="viewport" content="width=device-width" />' in head  # others stay
    assert "<title>App</title>" in head and "og:title stays in the body" in page


def test_preview_values_are_escaped():
    tags = preview_tags('http://h/?a="><script>', title="a & b")
    assert "<script>" not in tags and "&quot;&gt;&lt;script&gt;" in tags
    assert 'content="a &amp; b"' in tags
