// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::lm::ChatTemplate against transformers' apply_chat_template (render_jinja_template): the real
// templates of SmolLM2, Qwen2.5, Qwen3, Llama 3.1 and Llama 3.2 on 20 conversations each (tools,
// tool calls and results, reasoning, options), byte for byte, including the renders the templates
// refuse (fixtures from tests/oracle/gen_chat_templates.py); Jinja's whitespace rules and
// operators on small templates (each expected string checked with jinja2 under transformers'
// settings); and errors that name the construct.
#include <doctest/doctest.h>

#include <ctime>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include <nn/lm/chat_template.hpp>

#include "support/error_of.hpp"

namespace lm_chat_template {  // one unity source with the other lm files: its names stay its own

using nn::lm::ChatTemplate;
using Json = nlohmann::ordered_json;

namespace {

const std::string kDir = std::string(NN_FIXTURES_DIR) + "/lm/chat_templates/";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) FAIL("missing fixture " << path << " (regenerate with tests/oracle/gen_chat_templates.py)");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

using nn::test::contains;
using nn::test::error_of;

std::string render(const std::string& src, const Json& ctx = Json::object()) { return ChatTemplate(src, "t.jinja").render(ctx); }

// "2026-12-05T12:00:00" (the fixture's "now": the local time its renders were recorded at).
std::tm parse_local_time(const std::string& iso) {
  std::tm tm{};
  std::istringstream in(iso);
  in >> std::get_time(&tm, "%Y-%m-%dT%H:%M:%S");
  REQUIRE_MESSAGE(!in.fail(), "bad time ", iso);
  tm.tm_isdst = -1;
  std::tm norm = tm;
  std::mktime(&norm);  // fills the weekday and the day of the year that %a and %j print
  tm.tm_wday = norm.tm_wday;
  tm.tm_yday = norm.tm_yday;
  return tm;
}

}  // namespace

TEST_CASE("chat templates: SmolLM2, Qwen2.5, Qwen3, Llama 3.1 and 3.2 render as transformers renders them") {
  const Json exp = Json::parse(read_file(kDir + "expected.json"));
  MESSAGE("fixtures recorded with transformers ", exp["transformers_version"].get<std::string>());
  std::map<std::string, ChatTemplate> templates;
  int rendered = 0, refused = 0;
  for (const Json& c : exp["cases"]) {
    const std::string name = c["template"].get<std::string>();
    if (!templates.count(name)) {
      ChatTemplate t(read_file(kDir + name + ".jinja"), name + ".jinja");
      t.now = parse_local_time(exp["now"].get<std::string>());  // Llama 3's "Today Date" as recorded
      templates.emplace(name, std::move(t));
    }
    const ChatTemplate& t = templates.at(name);
    INFO(name, " conversation ", c["case"].get<int>());
    if (c.contains("error")) {
      // The template refuses (raise_exception, or Python refusing None + str): so does nn.
      const std::string err = error_of([&] { t.apply(c["messages"], c["add_generation_prompt"].get<bool>(), c["extra"], c["tools"]); });
      CHECK(err != "(no error)");
      if (contains(c["error"].get<std::string>(), "only supports single tool-calls"))
        CHECK(contains(err, "the template raised: This model only supports single tool-calls at once!"));
      ++refused;
      continue;
    }
    const std::string got = t.apply(c["messages"], c["add_generation_prompt"].get<bool>(), c["extra"], c["tools"]);
    const std::string want = c["text"].get<std::string>();
    if (got != want) {
      std::size_t d = 0;
      while (d < got.size() && d < want.size() && got[d] == want[d]) ++d;
      const std::size_t from = d > 40 ? d - 40 : 0;
      INFO("first difference at byte ", d, "\n got: ", Json(got.substr(from, 100)).dump(), "\nwant: ", Json(want.substr(from, 100)).dump());
      CHECK(got == want);
    }
    ++rendered;
  }
  MESSAGE(rendered, " renders identical, ", refused, " refused as transformers refuses them");
  CHECK(rendered + refused == 100);
}

TEST_CASE("chat templates: strftime_now formats ChatTemplate::now when set, else the clock") {
  ChatTemplate t("{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%A %j %H:%M') }}|{{ strftime_now() }}", "t.jinja");
  t.now = parse_local_time("2026-12-05T12:00:00");
  CHECK(t.render(Json::object()) == "05 Dec 2026|Saturday 339 12:00|2026-12-05");
  t.now = parse_local_time("2027-01-31T23:59:00");
  CHECK(t.render(Json::object()) == "31 Jan 2027|Sunday 031 23:59|2027-01-31");
  // Unset: today, as the C library formats it -- the year read before or after the render (a
  // render across New Year's midnight prints either).
  t.now.reset();
  const auto year_now = [] {
    const std::time_t clock = std::time(nullptr);
    std::tm local{};
    localtime_r(&clock, &local);
    char year[8];
    std::strftime(year, sizeof year, "%Y", &local);
    return std::string(year);
  };
  const std::string before = year_now(), got = t.render(Json::object()), after = year_now();
  CHECK((contains(got, before) || contains(got, after)));
}

TEST_CASE("chat templates: Jinja's whitespace control, trim_blocks and lstrip_blocks") {
  CHECK(render("a\n{% if true %}\n  b\n{% endif %}\nc") == "a\n  b\nc");
  CHECK(render("  {% if true %}x{% endif %}  ") == "x  ");       // lstrip_blocks at the start
  CHECK(render("a  {% if true %}x{% endif %}") == "a  x");        // not alone on its line: kept
  CHECK(render("a {{- ' b ' -}} c") == "a b c");
  CHECK(render("a\n  {%- if true -%}\n  b  {%- endif %} c") == "ab c");
  CHECK(render("{# note #}\nx\n") == "x");                          // comment + trim_blocks; trailing newline dropped
  CHECK(render("{% if true +%}\nx{% endif %}") == "\nx");          // "+%}" keeps the newline
  CHECK(render("x\r\ny") == "x\ny");                                // newlines normalized
  CHECK(render("{% for i in range(3) %}\n    {% set j = i * 2 %}\n    {{ j }},\n{% endfor %}") == "    0,\n    2,\n    4,\n");
}

TEST_CASE("chat templates: expressions, filters, tests, loops and scoping") {
  CHECK(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1 + 2 * 3 }}") == "3 -4 -2 1024 3.5 7");
  CHECK(render("{{ 'a' ~ 1 ~ none }} {{ none }} {{ true }} {{ [1, 'x', none] }} {{ {'k': 'v'} }}") == "a1None None True [1, 'x', None] {'k': 'v'}");
  CHECK(render("{{ x | tojson }}|{{ x | tojson(indent=2) }}", {{"x", Json::parse(R"({"a": [1, 2.5, "é\n"], "b": {}})")}}) ==
        "{\"a\": [1, 2.5, \"é\\n\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"b\": {}\n}");
  CHECK(render("{{ 'a,b,,c'.split(',') }} {{ ' x '.strip() }}|{{ 'xxhixx'.strip('x') }} {{ 'Hi'.upper() }} {{ 'hello'[1:3] }} {{ [1,2,3][::-1] }}") ==
        "['a', 'b', '', 'c'] x|hi HI el [3, 2, 1]");
  CHECK(render("{{ xs | length }} {{ xs | join('-') }} {{ xs | first }} {{ xs | last }} {{ xs | reject('equalto', 2) | list }} {{ xs | select('odd') | list }}",
               {{"xs", {1, 2, 3}}}) == "3 1-2-3 1 3 [1, 3] [1, 3]");
  CHECK(render("{{ u is defined }} {{ u is undefined }} {{ n is none }} {{ 's' is string }} {{ d is mapping }} {{ 3 is odd }} {{ 4 is divisibleby 2 }} {{ false is false }}",
               {{"n", nullptr}, {"d", Json::object()}}) == "False True True True True True True True");
  CHECK(render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in d }} {{ 'z' not in d }} {{ 1 if false else 2 }} {{ 1 if false }}.", {{"d", {{"k", 1}}}}) ==
        "True True True True 2 .");
  CHECK(render("{% for k, v in d | items %}{{ loop.index }}{{ k }}={{ v }}{% if not loop.last %}, {% endif %}{% endfor %}",
               {{"d", {{"a", 1}, {"b", 2}}}}) == "1a=1, 2b=2");
  CHECK(render("{% for x in xs if x > 1 %}{{ x }}{% else %}none{% endfor %}|{% for x in [] %}{% else %}empty{% endfor %}", {{"xs", {1, 2, 3}}}) ==
        "23|empty");
  CHECK(render("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}") == "013");
  // A for loop's assignments stay inside it; a namespace carries them out.
  CHECK(render("{% set a = 1 %}{% set ns = namespace(b=1) %}{% for i in range(3) %}{% set a = a + 1 %}{% set ns.b = ns.b + 1 %}{% endfor %}{{ a }} {{ ns.b }}") == "1 4");
  CHECK(render("{% set t %}in {{ 1 + 1 }}{% endset %}[{{ t }}] {% set p, q = 1, 2 %}{{ p }}{{ q }}") == "[in 2] 12");
  CHECK(render("{{ d.get('x', 5) }} {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %} {{ d.missing is defined }}", {{"d", {{"y", 1}}}}) ==
        "5 y1 False");
  CHECK(render("{% generation %}kept{% endgeneration %}") == "kept");
}

TEST_CASE("chat templates: errors name the construct and the line") {
  CHECK(contains(error_of([] { render("a\n{% macro m() %}{% endmacro %}"); }), "t.jinja line 2: unsupported tag {% macro %}"));
  CHECK(contains(error_of([] { render("{{ x | wat }}"); }), "unsupported filter 'wat'"));
  CHECK(contains(error_of([] { render("{{ x is wat }}"); }), "unsupported test 'wat'"));
  CHECK(contains(error_of([] { render("{{ 'a'.zfill(3) }}"); }), "is not callable"));
  CHECK(contains(error_of([] { render("{% if x %}"); }), "{% if %} without {% endif %}"));
  CHECK(contains(error_of([] { render("{{ x "); }), "unclosed {{"));
  CHECK(contains(error_of([] { render("{{ 'a' + 1 }}"); }), "unsupported operand types for +"));
  CHECK(contains(error_of([] { render("{{ u.x }}"); }), "'u' is undefined"));
  CHECK(contains(error_of([] { render("{{ raise_exception('no system role') }}"); }), "the template raised: no system role"));
  CHECK(contains(error_of([] { render("{% endfor %}"); }), "unexpected {% endfor %}"));
  CHECK(contains(error_of([] { ChatTemplate("{{ 1 }}").apply(Json::object(), true); }), "messages must be a JSON array"));
  // A template is input: no stack overflow, no endless render.
  CHECK(contains(error_of([] { render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"); }), "nested more than 200"));
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "{% if true %}";
  CHECK(contains(error_of([&] { render(deep); }), "blocks nested more than 200 deep"));
  ChatTemplate slow("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "slow.jinja");
  CHECK(slow.max_steps == 20'000'000);
  slow.max_steps = 100'000;  // the default bound is hit the same way, 200 times later
  CHECK(contains(error_of([&] { slow.render(Json::object()); }), "more than 100000 statements and loop turns"));
  ChatTemplate big("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "big.jinja");
  big.max_output = 1 << 20;
  CHECK(contains(error_of([&] { big.render(Json::object()); }), "passed 1048576 bytes"));
}

}  // namespace lm_chat_template
