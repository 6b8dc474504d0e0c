//! PLACEHOLDER (replaced by the real chat template).
use anyhow::Result;
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage { pub role: String, pub content: String }
pub struct ChatTemplate;
impl ChatTemplate {
    pub fn new(_s: &str, _b: Option<String>, _e: Option<String>) -> Result<Self> { Ok(Self) }
    pub fn chatml() -> Self { Self }
    pub fn render(&self, m: &[ChatMessage], g: bool) -> Result<String> {
        let mut s = String::new();
        for x in m { s += &format!("<|im_start|>{}\n{}<|im_end|>\n", x.role, x.content); }
        if g { s += "<|im_start|>assistant\n"; }
        Ok(s)
    }
}
