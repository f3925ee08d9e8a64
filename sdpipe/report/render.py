"""HTML and Markdown from one document (document.py), with jinja2 templates kept here as plain strings.

HTML autoescapes every value (prompts and paths come from the user's config). Markdown has no autoescape, so every
value goes through the `md` filter: HTML-escaped (a Markdown viewer renders raw HTML) and Markdown-escaped.
"""

from __future__ import annotations

import html
import re

import jinja2
from markupsafe import Markup

from sdpipe.report.document import LEGEND, TIMING

CSS = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: .5rem 0 1.2rem; } caption { text-align: left; font-weight: 600; }
th, td { border: 1px solid #ccc; padding: .25rem .6rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.timing { background: #fff8e6; } .legend, .note { color: #555; }
figure { margin: 1rem 0 1.5rem; } img { max-width: 100%; border: 1px solid #ddd; }
figcaption ul { margin: .3rem 0; padding-left: 1.2rem; font-size: .9rem; }
"""

HTML = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>sdpipe report</title><style>{{ css }}</style></head>
<body>
<h1>sdpipe report</h1>
<p class="legend">{{ legend }}</p>
{% macro td(cell) -%}
{% if cell.timing %}<td class="timing">{{ cell.text }} {{ timing }}</td>{% else %}<td>{{ cell.text }}</td>{% endif %}
{%- endmacro %}
{% for section in sections %}
<h2>{{ section.title }}</h2>
{% for b in section.blocks %}
{% if b.kind == "table" %}
<table>{% if b.caption %}<caption>{{ b.caption }}</caption>{% endif %}

<tr>{% for c in b.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in b.rows %}
<tr>{% for cell in row %}{{ td(cell) }}{% endfor %}</tr>
{% endfor %}
</table>
{% elif b.kind == "figure" %}
<figure><img src="{{ assets }}/{{ b.src }}" alt="{{ b.caption }}">
<figcaption>{% if b.timing %}{{ timing }} {% endif %}{{ b.caption }}
{% if b.lines %}<ul>{% for line in b.lines %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}
</figcaption></figure>
{% else %}
<p class="note">{{ b.text }}</p>
{% endif %}
{% endfor %}
{% endfor %}
</body>
</html>
"""

# Each table row is one line, so a line with a timing carries the TIMING mark and nothing else changes between runs.
MARKDOWN = """# sdpipe report

{{ legend | md }}
{% for section in sections %}

## {{ section.title | md }}
{% for b in section.blocks %}

{% if b.kind == "table" %}
{% if b.caption %}*{{ b.caption | md }}*

{% endif %}
|{% for c in b.columns %} {{ c | md }} |{% endfor %}

|{% for c in b.columns %} --- |{% endfor %}

{% for row in b.rows %}
|{% for cell in row %} {{ cell.text | md }}{{ (" " ~ timing) if cell.timing else "" }} |{% endfor %}

{% endfor %}
{% elif b.kind == "figure" %}
![{{ b.caption | md }}]({{ assets }}/{{ b.src }})

{% if b.timing %}{{ timing }} {% endif %}*{{ b.caption | md }}*
{% for line in b.lines %}
- {{ line | md }}
{% endfor %}
{% else %}
*{{ b.text | md }}*
{% endif %}
{% endfor %}
{% endfor %}
"""

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#])")


def md_escape(value) -> str:
    """One line of literal Markdown text: newlines folded, HTML and Markdown syntax escaped."""
    text = html.escape(" ".join(str(value).split()), quote=False)
    return _MD_SPECIAL.sub(r"\\\1", text)


def _env(autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        autoescape=autoescape,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["md"] = md_escape
    return env


def to_html(sections: list, assets: str) -> str:
    return (
        _env(True)
        .from_string(HTML)
        .render(sections=sections, assets=assets, legend=LEGEND, timing=TIMING, css=Markup(CSS))
    )  # ours, not user text


def to_markdown(sections: list, assets: str) -> str:
    text = _env(False).from_string(MARKDOWN).render(sections=sections, assets=assets, legend=LEGEND, timing=TIMING)
    return re.sub(r"\n{3,}", "\n\n", text)  # the template's spacing, normalised to one blank line between blocks
