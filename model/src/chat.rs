//! Chat prompts: the model's own Jinja chat template (`tokenizer.chat_template`),
//! rendered by minijinja in a sandbox with limits.
//!
//! Templates are untrusted input from the model file. They run with no file system or
//! network access (minijinja has none), with a fuel limit on the instructions executed, a
//! recursion limit, and a cap on the size of the output, so a hostile template ends in a
//! [`ChatTemplateError`] instead of a hang or an exhausted memory.
//!
//! The environment is the one chat templates are written for: `trim_blocks` and
//! `lstrip_blocks` on, `break`/`continue`, Python string and dict methods
//! (`.strip()`, `.items()`, ...), the variables `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`, and the functions `raise_exception(message)` and
//! `strftime_now(format)` (UTC).
//!
//! A model without a template gets a built-in one where its family is known: Gemma's turn
//! format for `gemma`, `gemma2` and `gemma3`; Phi-3's for `phi3` when the vocabulary has
//! its role tokens; ChatML when the vocabulary has ChatML's
//! tokens. Otherwise there is no chat format to guess and [`ChatTemplate::from_metadata`]
//! says so.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gguf_format::{GgufError, Metadata, StringArray};
use minijinja::{Environment, ErrorKind, Value};

/// The metadata key holding the template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// Gemma's turn format, for Gemma files that carry no template. System messages are
/// folded into the next user turn, as Gemma has no system role.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}
{%- set state = namespace(system='') %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- set state.system = state.system + (message.content | trim) + '\\n\\n' %}
  {%- else %}
    {%- set role = 'model' if message.role == 'assistant' else message.role %}
    {{- '<start_of_turn>' + role + '\\n' + state.system + (message.content | trim) + '<end_of_turn>\\n' }}
    {%- set state.system = '' %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}";

/// Phi-3's turns, as llama.cpp's built-in `phi3` format writes them.
const PHI3_TEMPLATE: &str = "{%- for message in messages %}
{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}";

/// ChatML, for files without a template whose vocabulary has `<|im_start|>`.
const CHATML_TEMPLATE: &str = "{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Why a chat prompt could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("the model has no chat template ({CHAT_TEMPLATE_KEY}) and architecture {architecture:?} has no built-in one")]
    Missing { architecture: String },
    #[error("chat template metadata: {0}")]
    Metadata(#[from] GgufError),
    #[error("chat template does not parse: {message}")]
    Syntax { message: String },
    #[error("chat template ran out of fuel after {fuel} instructions")]
    OutOfFuel { fuel: u64 },
    #[error("chat template output exceeds {limit} bytes")]
    OutputTooLarge { limit: usize },
    #[error("chat template raised an exception: {message}")]
    Raised { message: String },
    #[error("chat template failed: {message}")]
    Render { message: String },
}

/// What a template may spend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatLimits {
    /// Template instructions executed per render.
    pub fuel: u64,
    /// Nesting of loops, conditions and macro calls.
    pub recursion: usize,
    /// Bytes of rendered output.
    pub max_output_bytes: usize,
}

impl Default for ChatLimits {
    /// Generous for any real template (they use a few thousand instructions), small
    /// enough that a runaway one stops within a fraction of a second.
    fn default() -> ChatLimits {
        ChatLimits {
            fuel: 2_000_000,
            recursion: 100,
            max_output_bytes: 8 << 20,
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// An assistant's tool calls, as the template reads them (a list of OpenAI's
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`); only rendered
    /// when set.
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers; only rendered when set.
    pub tool_call_id: Option<String>,
    /// The name of the tool that answered, or of the speaker; only rendered when set.
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }
}

/// A chat template with the special-token texts it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    built_in: bool,
    limits: ChatLimits,
}

impl ChatTemplate {
    /// A template from its source.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            built_in: false,
            limits: ChatLimits::default(),
        }
    }

    /// `source` (a template from elsewhere than the file, as `--chat-template-file`
    /// gives one) with the texts of the BOS and EOS tokens `metadata` names.
    pub fn from_source_and_metadata(
        source: impl Into<String>,
        metadata: &Metadata,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let tokens = metadata.get_string_array("tokenizer.ggml.tokens")?;
        let (bos_token, eos_token) = bos_eos_texts(metadata, tokens)?;
        Ok(ChatTemplate::new(source, bos_token, eos_token))
    }

    /// The template a GGUF file carries, or the built-in one for its family (see the
    /// module docs). `bos_token` and `eos_token` are the texts of the ids the metadata
    /// names, empty when it names none.
    pub fn from_metadata(metadata: &Metadata) -> Result<ChatTemplate, ChatTemplateError> {
        let tokens = metadata.get_string_array("tokenizer.ggml.tokens")?;
        let (bos_token, eos_token) = bos_eos_texts(metadata, tokens)?;
        if let Some(source) = metadata.get_opt::<&str>(CHAT_TEMPLATE_KEY)? {
            return Ok(ChatTemplate::new(source, bos_token, eos_token));
        }
        let architecture = metadata
            .get_opt::<&str>("general.architecture")?
            .unwrap_or_default();
        let has = |text: &str| tokens.iter().any(|t| t == text);
        let source = if matches!(architecture, "gemma" | "gemma2" | "gemma3") {
            GEMMA_TEMPLATE
        } else if architecture == "phi3" && has("<|user|>") && has("<|end|>") {
            PHI3_TEMPLATE
        } else if has("<|im_start|>") && has("<|im_end|>") {
            CHATML_TEMPLATE
        } else {
            return Err(ChatTemplateError::Missing {
                architecture: architecture.to_owned(),
            });
        };
        let mut template = ChatTemplate::new(source, bos_token, eos_token);
        template.built_in = true;
        Ok(template)
    }

    /// Replaces the default limits.
    pub fn with_limits(mut self, limits: ChatLimits) -> ChatTemplate {
        self.limits = limits;
        self
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// True when the file had no template and a built-in one is used.
    pub fn is_built_in(&self) -> bool {
        self.built_in
    }

    /// The family of the built-in template in use (`"Gemma"`, `"ChatML"`), `None` when
    /// the file had its own.
    pub fn built_in_name(&self) -> Option<&'static str> {
        if !self.built_in {
            None
        } else if self.source == GEMMA_TEMPLATE {
            Some("Gemma")
        } else if self.source == PHI3_TEMPLATE {
            Some("Phi-3")
        } else {
            Some("ChatML")
        }
    }

    /// Renders `messages`, ending with the opening of the assistant's turn when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` as [`ChatTemplate::render`] does, with the variable `tools`
    /// (the list of OpenAI tool objects, `{"type": "function", "function": {"name",
    /// "description", "parameters"}}`, as transformers and llama.cpp pass it) when
    /// `tools` is given. Without it the template sees no `tools` variable at all.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let raised = Arc::new(Mutex::new(None::<String>));
        let env = self.environment(Arc::clone(&raised));
        let template =
            env.template_from_str(&self.source)
                .map_err(|e| ChatTemplateError::Syntax {
                    message: e.to_string(),
                })?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut fields = BTreeMap::from([
                    ("role", Value::from(&m.role)),
                    ("content", Value::from(&m.content)),
                ]);
                if let Some(calls) = &m.tool_calls {
                    fields.insert("tool_calls", json_value(calls));
                }
                if let Some(id) = &m.tool_call_id {
                    fields.insert("tool_call_id", Value::from(id));
                }
                if let Some(name) = &m.name {
                    fields.insert("name", Value::from(name));
                }
                Value::from(fields)
            })
            .collect();
        let mut context = BTreeMap::from([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]);
        if let Some(tools) = tools {
            context.insert("tools", tools.iter().map(json_value).collect());
        }
        let context = Value::from(context);
        let mut out = CappedOutput::new(self.limits.max_output_bytes);
        let rendered = template.render_captured_to(context, &mut out).map(drop);
        match rendered {
            Ok(()) => String::from_utf8(out.bytes).map_err(|e| ChatTemplateError::Render {
                message: e.to_string(),
            }),
            Err(e) => Err(self.classify(&e, &out, &raised)),
        }
    }

    /// The text of a prompt with one user message, as llama.cpp prepares it: rendered
    /// with the generation prompt, and without a leading BOS text when the tokenizer
    /// adds BOS itself (so it is not there twice).
    pub fn user_prompt(
        &self,
        content: &str,
        tokenizer_adds_bos: bool,
    ) -> Result<String, ChatTemplateError> {
        self.prompt(&[ChatMessage::user(content)], tokenizer_adds_bos)
    }

    /// The text of a prompt for a conversation, prepared as [`ChatTemplate::user_prompt`]
    /// prepares one message.
    pub fn prompt(
        &self,
        messages: &[ChatMessage],
        tokenizer_adds_bos: bool,
    ) -> Result<String, ChatTemplateError> {
        self.prompt_with_tools(messages, None, tokenizer_adds_bos)
    }

    /// [`ChatTemplate::prompt`] with the tools the model is offered (see
    /// [`ChatTemplate::render_with_tools`]).
    pub fn prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        tokenizer_adds_bos: bool,
    ) -> Result<String, ChatTemplateError> {
        let text = self.render_with_tools(messages, tools, true)?;
        match text.strip_prefix(self.bos_token.as_str()) {
            Some(rest) if tokenizer_adds_bos && !self.bos_token.is_empty() => Ok(rest.to_owned()),
            _ => Ok(text),
        }
    }

    fn environment(&self, raised: Arc<Mutex<Option<String>>>) -> Environment<'_> {
        let mut env = Environment::new();
        env.set_fuel(Some(self.limits.fuel));
        env.set_recursion_limit(self.limits.recursion);
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .unwrap_or_default();
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            move |message: String| -> Result<Value, minijinja::Error> {
                if let Ok(mut slot) = raised.lock() {
                    *slot = Some(message.clone());
                }
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function(
            "strftime_now",
            |format: String| -> Result<String, minijinja::Error> {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as i64);
                format_utc(now, &format)
                    .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))
            },
        );
        env
    }

    fn classify(
        &self,
        error: &minijinja::Error,
        out: &CappedOutput,
        raised: &Mutex<Option<String>>,
    ) -> ChatTemplateError {
        if out.overflowed {
            return ChatTemplateError::OutputTooLarge {
                limit: self.limits.max_output_bytes,
            };
        }
        if error.kind() == ErrorKind::OutOfFuel {
            return ChatTemplateError::OutOfFuel {
                fuel: self.limits.fuel,
            };
        }
        if let Some(message) = raised.lock().ok().and_then(|mut slot| slot.take()) {
            return ChatTemplateError::Raised { message };
        }
        if error.kind() == ErrorKind::SyntaxError {
            return ChatTemplateError::Syntax {
                message: error.to_string(),
            };
        }
        ChatTemplateError::Render {
            message: error.to_string(),
        }
    }
}

/// A JSON value as the template sees it: objects as maps, arrays as sequences.
fn json_value(value: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            (None, None) => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => items.iter().map(json_value).collect(),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

/// The texts of the BOS and EOS ids `metadata` names (empty where it names none).
fn bos_eos_texts(
    metadata: &Metadata,
    tokens: &StringArray,
) -> Result<(String, String), ChatTemplateError> {
    let token_text = |key: &str| -> Result<String, ChatTemplateError> {
        let id = metadata.get_opt::<u32>(key)?;
        Ok(id
            .and_then(|id| tokens.get(id as usize))
            .map(|text| text.to_owned())
            .unwrap_or_default())
    };
    Ok((
        token_text("tokenizer.ggml.bos_token_id")?,
        token_text("tokenizer.ggml.eos_token_id")?,
    ))
}

/// A writer that refuses to grow past a limit.
struct CappedOutput {
    bytes: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl CappedOutput {
    fn new(limit: usize) -> CappedOutput {
        CappedOutput {
            bytes: Vec::new(),
            limit,
            overflowed: false,
        }
    }
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output limit reached"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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

/// Formats `unix_seconds` (UTC) with the strftime directives templates use: `%Y %y %m
/// %d %e %j %H %I %M %S %p %b %B %a %A %%`. Others are an error naming them.
fn format_utc(unix_seconds: i64, format: &str) -> Result<String, String> {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
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
        let directive = chars.next().ok_or("strftime format ends with a lone %")?;
        let piece = match directive {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:2}"),
            'j' => format!("{day_of_year:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            'b' => month_name[..3].to_owned(),
            'B' => month_name.to_owned(),
            'a' => weekday_name[..3].to_owned(),
            'A' => weekday_name.to_owned(),
            '%' => "%".to_owned(),
            other => return Err(format!("strftime directive %{other} is not supported")),
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Year, month (1..=12) and day (1..=31) of a day count from 1970-01-01, in the
/// proleptic Gregorian calendar (eras of 400 years, years starting in March).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
#[path = "chat_tests.rs"]
mod tests;
