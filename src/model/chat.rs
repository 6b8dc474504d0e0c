//! Chat prompt formatting with the model's own Jinja template, rendered the
//! way Hugging Face `apply_chat_template` does (minijinja in place of jinja2).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::quantized::gguf_file;
use minijinja::value::Value;
use minijinja::{context, Environment, Error, ErrorKind};

use super::tokenizer::TextTokenizer;

const TEMPLATE_NAME: &str = "chat";

/// Plain ChatML, used when a model ships no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the special tokens it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported with their location.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        // transformers compiles with trim_blocks/lstrip_blocks and the default
        // keep_trailing_newline=False, which is minijinja's default too.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("invalid chat template: {e:#}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The built-in ChatML template.
    pub fn chatml() -> Self {
        // The source is a constant covered by tests, so compiling cannot fail.
        Self::new(CHATML_TEMPLATE, None, None).expect("built-in ChatML template compiles")
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), with the
    /// tokenizer's BOS/EOS; ChatML when the file has none.
    pub fn from_gguf(content: &gguf_file::Content, tokenizer: &TextTokenizer) -> Result<Self> {
        match gguf_chat_template(content) {
            Some(src) => Self::for_tokenizer(&src, tokenizer),
            None => Ok(Self::chatml()),
        }
    }

    /// The template of a Hugging Face model directory; ChatML when it has none.
    pub fn from_hf_dir(dir: &Path, tokenizer: &TextTokenizer) -> Result<Self> {
        match hf_chat_template(dir)? {
            Some(src) => Self::for_tokenizer(&src, tokenizer),
            None => Ok(Self::chatml()),
        }
    }

    fn for_tokenizer(source: &str, tokenizer: &TextTokenizer) -> Result<Self> {
        Self::new(
            source,
            tokenizer.bos_token().map(|(s, _)| s),
            tokenizer.eos_token(),
        )
    }

    /// Renders the conversation to prompt text. Special tokens appear as text;
    /// `TextTokenizer::encode` maps them back to their ids.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template missing: {e}"))?;
        // A missing token is "" rather than undefined, so templates doing
        // `bos_token + ...` still render (jinja2 would raise there).
        let token = |t: &Option<String>| Value::from(t.as_deref().unwrap_or(""));
        let ctx = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => token(&self.bos_token),
            eos_token => token(&self.eos_token),
            tools => Value::from(()),
        };
        // Plain Display: the alternate form would dump all variables, i.e.
        // the whole conversation, into the error.
        template
            .render(ctx)
            .map_err(|e| anyhow!("cannot render chat template: {e}"))
    }
}

/// `tokenizer.chat_template` from GGUF metadata, if present.
pub fn gguf_chat_template(content: &gguf_file::Content) -> Option<String> {
    match content.metadata.get("tokenizer.chat_template") {
        Some(gguf_file::Value::String(s)) if !s.trim().is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// The chat template of a Hugging Face model directory: `chat_template.jinja`,
/// else `chat_template` in `tokenizer_config.json` (a string, or a list of
/// named templates of which "default" is used).
pub fn hf_chat_template(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let src = std::fs::read_to_string(&jinja)
            .with_context(|| format!("cannot read {}", jinja.display()))?;
        return Ok(Some(src));
    }
    let config_path = dir.join("tokenizer_config.json");
    if !config_path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("invalid JSON in {}", config_path.display()))?;
    Ok(match config.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

/// `raise_exception(msg)`: templates use it to reject unsupported input.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: current UTC time, common strftime codes only
/// (Llama 3.1+ templates print today's date with it).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?
        .as_secs();
    strftime(&format, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with a subset of C strftime.
fn strftime(format: &str, unix_secs: u64) -> Result<String, Error> {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(code) = chars.next() else {
            out.push('%');
            break;
        };
        match code {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:>2}")),
            'j' => out.push_str(&format!("{day_of_year:03}")),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'B' => out.push_str(month_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'A' => out.push_str(weekday_name),
            'a' => out.push_str(&weekday_name[..3]),
            'F' => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            'T' => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format code %{other}"),
                ))
            }
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    // Expected strings below were produced by rendering the same templates
    // with Python jinja2 configured like transformers' apply_chat_template
    // (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks).

    fn user(c: &str) -> ChatMessage {
        ChatMessage::new("user", c)
    }
    fn system(c: &str) -> ChatMessage {
        ChatMessage::new("system", c)
    }
    fn assistant(c: &str) -> ChatMessage {
        ChatMessage::new("assistant", c)
    }

    /// `tokenizer.chat_template` of SmolLM2-135M-Instruct (its string
    /// literals contain real newlines).
    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// `tokenizer.chat_template` of Qwen2.5-Coder-0.5B-Instruct.
    const QWEN25_TEMPLATE: &str = r###"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"###;

    /// Meta-Llama-3-8B-Instruct's chat template.
    const LLAMA3_TEMPLATE: &str = r#"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"#;

    /// Mistral-7B-Instruct-v0.1's chat template (uses raise_exception).
    const MISTRAL_TEMPLATE: &str = r#"{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"#;

    fn gguf_template(path: PathBuf) -> Option<String> {
        if !path.exists() {
            eprintln!("skipping: {} not found", path.display());
            return None;
        }
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        gguf_chat_template(&content)
    }

    fn smollm2_gguf() -> PathBuf {
        std::env::var_os("LIFT_TEST_GGUF")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    }

    #[test]
    fn is_send_and_sync() {
        // Shared across request handlers behind an Arc.
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }

    #[test]
    fn smollm2_template() {
        let t = ChatTemplate::new(
            SMOLLM2_TEMPLATE,
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
        )
        .unwrap();
        // No system message: the template inserts its default one.
        assert_eq!(
            t.render(&[user("Hi")], true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[user("Hi")], false).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        // An explicit system message replaces the default.
        let chat = [
            system("Be brief."),
            user("Hi"),
            assistant("Hello!"),
            user("Bye"),
        ];
        assert_eq!(
            t.render(&chat, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn smollm2_gguf_template_and_tokens() {
        let path = smollm2_gguf();
        let Some(src) = gguf_template(path.clone()) else {
            panic!("{} missing: run `lift-serve fetch-model`", path.display());
        };
        assert_eq!(src, SMOLLM2_TEMPLATE);
        // End to end: template from the GGUF, BOS/EOS from its tokenizer.
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let tok = TextTokenizer::from_gguf(&content, &path).unwrap();
        let t = ChatTemplate::from_gguf(&content, &tok).unwrap();
        let prompt = t.render(&[user("Hi")], true).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tok.encode(&prompt, true).unwrap();
        assert_eq!(
            ids.iter().filter(|&&id| id == 1).count(),
            3,
            "three <|im_start|>"
        );
        assert_eq!(
            ids.iter().filter(|&&id| id == 2).count(),
            2,
            "two <|im_end|>"
        );
        assert_eq!(tok.decode(&ids).unwrap(), prompt);
    }

    #[test]
    fn qwen25_template() {
        if let Some(src) = gguf_template(PathBuf::from(
            std::env::var("LIFT_TEST_QWEN_GGUF")
                .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/models/qwen2.5-coder-0.5b-instruct.gguf").into()),
        )) {
            assert_eq!(src, QWEN25_TEMPLATE);
        }
        let t = ChatTemplate::new(QWEN25_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
        assert_eq!(
            t.render(&[user("Hi")], true).unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let chat = [
            system("Be brief."),
            user("Hi"),
            assistant("Hello!"),
            user("Bye"),
        ];
        assert_eq!(
            t.render(&chat, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_template_uses_bos() {
        let t = ChatTemplate::new(
            LLAMA3_TEMPLATE,
            Some("<|begin_of_text|>".into()),
            Some("<|eot_id|>".into()),
        )
        .unwrap();
        assert_eq!(
            t.render(&[system("You are a bot."), user("  Hi  ")], true).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a bot.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // Without a BOS token the variable is an empty string.
        let t = ChatTemplate::new(LLAMA3_TEMPLATE, None, None).unwrap();
        assert!(t
            .render(&[user("Hi")], false)
            .unwrap()
            .starts_with("<|start_header_id|>user"));
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t =
            ChatTemplate::new(MISTRAL_TEMPLATE, Some("<s>".into()), Some("</s>".into())).unwrap();
        assert_eq!(
            t.render(&[user("Hi"), assistant("Hello"), user("Bye")], true)
                .unwrap(),
            "<s>[INST] Hi [/INST]Hello</s> [INST] Bye [/INST]"
        );
        let err = t
            .render(&[assistant("Hello")], true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Conversation roles must alternate"), "{err}");
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::chatml();
        assert_eq!(
            t.render(&[system("S"), user("Hi")], true).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(t.render(&[], false).unwrap(), "");
    }

    #[test]
    fn python_string_methods_and_whitespace_control() {
        let src = "{% for m in messages %}\n  {% if m.content.strip().startswith('x') %}\n{{ m.role.upper() }}:{{ m.content.strip() }}\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        // trim_blocks eats the newline after a tag, lstrip_blocks the indent before it.
        assert_eq!(
            t.render(&[user("  xy "), user("no")], false).unwrap(),
            "USER:xy\n"
        );
        let t = ChatTemplate::new(
            "{{ tools is none }}/{{ add_generation_prompt }}",
            None,
            None,
        )
        .unwrap();
        // Booleans print the Python way, as jinja2 does.
        assert_eq!(t.render(&[], true).unwrap(), "True/True");
    }

    #[test]
    fn syntax_errors_are_reported() {
        let err =
            ChatTemplate::new("{% for m in messages %}{{ m.content }}", None, None).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("invalid chat template") && msg.contains("syntax error"),
            "{msg}"
        );
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 00:00:00 UTC, a Friday (checked with Python's datetime).
        let t = 1_721_952_000;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %I%p %F %T %%", t + 13 * 3600 + 62).unwrap(),
            "Friday July 208 01PM 2024-07-26 13:01:02 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert_eq!(
            strftime("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
        assert!(strftime("%Q", t).is_err());
        for days in [-1000, 0, 59, 11_016, 20_000, 50_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        let t = ChatTemplate::new("{{ strftime_now('%Y') | length }}", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "4");
    }

    #[test]
    fn hf_dir_template_lookup() {
        let dir = std::env::temp_dir().join(format!("lift-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(hf_chat_template(&dir).unwrap(), None);
        let cfg = dir.join("tokenizer_config.json");
        std::fs::write(&cfg, r#"{"chat_template": "A{{ 1 }}"}"#).unwrap();
        assert_eq!(hf_chat_template(&dir).unwrap().as_deref(), Some("A{{ 1 }}"));
        std::fs::write(&cfg, r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#).unwrap();
        assert_eq!(hf_chat_template(&dir).unwrap().as_deref(), Some("D"));
        std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
        assert_eq!(hf_chat_template(&dir).unwrap().as_deref(), Some("J"));
        std::fs::write(&cfg, "{not json").unwrap();
        std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
        let err = format!("{:#}", hf_chat_template(&dir).unwrap_err());
        assert!(err.contains("tokenizer_config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
