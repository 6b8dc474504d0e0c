//! Auxiliary QA generation (placeholder type until the QA work lands).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum QaSource {
    Model,
    Extractive,
}
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct QaPair {
    pub question: String,
    pub answer: String,
    pub evidence: String,
    pub evidence_span: (usize, usize),
    pub source: QaSource,
}
