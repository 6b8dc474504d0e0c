//! PLACEHOLDER (replaced by the real GGUF/HF tokenizer).
use anyhow::Result;
use candle_core::quantized::gguf_file;
use std::path::Path;
pub struct TextTokenizer { inner: tokenizers::Tokenizer, eos: Vec<u32> }
impl TextTokenizer {
    pub fn from_gguf(_c: &gguf_file::Content, _p: &Path) -> Result<Self> { anyhow::bail!("placeholder") }
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
        Ok(Self { inner, eos: vec![] })
    }
    pub fn encode(&self, text: &str, _add_bos: bool) -> Result<Vec<u32>> { Ok(self.inner.encode(text, false).map_err(anyhow::Error::msg)?.get_ids().to_vec()) }
    pub fn decode(&self, ids: &[u32]) -> Result<String> { self.inner.decode(ids, false).map_err(anyhow::Error::msg) }
    pub fn token_to_id(&self, s: &str) -> Option<u32> { self.inner.token_to_id(s) }
    pub fn vocab_size(&self) -> usize { self.inner.get_vocab_size(true) }
    pub fn bos_token(&self) -> Option<(String, u32)> { None }
    pub fn eos_token_ids(&self) -> &[u32] { &self.eos }
    pub fn eos_token(&self) -> Option<String> { None }
    pub fn decode_stream(&self) -> DecodeStream<'_> { DecodeStream { tok: self, ids: vec![], emitted: 0 } }
}
pub struct DecodeStream<'a> { tok: &'a TextTokenizer, ids: Vec<u32>, emitted: usize }
impl DecodeStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let s = self.tok.decode(&self.ids)?;
        if s.ends_with('\u{fffd}') { return Ok(None); }
        let new = s[self.emitted.min(s.len())..].to_string();
        self.emitted = s.len();
        Ok(if new.is_empty() { None } else { Some(new) })
    }
}
