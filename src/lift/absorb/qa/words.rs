//! Words shared by both sources: tokens, stopwords, question normalisation for deduplication.

const STOPWORDS: &[&str] = &[
    "a", "an", "the", "and", "or", "but", "nor", "so", "yet", "of", "in", "on", "at", "to", "for", "from", "by",
    "with", "about", "as", "into", "onto", "over", "under", "after", "before", "during", "since", "until", "than",
    "that", "this", "these", "those", "there", "here", "it", "its", "he", "she", "they", "them", "his", "her", "their",
    "we", "our", "us", "you", "your", "i", "me", "my", "mine", "is", "are", "was", "were", "be", "been", "being", "am",
    "do", "does", "did", "has", "have", "had", "will", "would", "can", "could", "should", "shall", "may", "might",
    "must", "not", "no", "yes", "if", "then", "when", "where", "which", "who", "whom", "whose", "what", "why", "how",
    "all", "any", "each", "every", "some", "such", "also", "very", "just", "only", "too", "one", "both", "either",
    "neither", "while", "because", "although", "though", "however", "thus", "hence", "according", "document", "text",
    "up", "out", "off", "again", "more", "most", "other", "own", "same", "per", "via", "between", "through", "across",
    "against", "among", "within", "without", "near", "upon", "toward", "towards", "like", "unlike", "once", "now",
    "still", "even", "ever", "never", "always", "often", "many", "much",
];

pub(super) fn is_stopword(w: &str) -> bool {
    STOPWORDS.contains(&w.to_lowercase().as_str())
}

/// Lower-case alphanumeric tokens.
pub(super) fn tokens(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric()).filter(|t| !t.is_empty()).map(|t| t.to_lowercase()).collect()
}

pub(super) fn content_tokens(s: &str) -> Vec<String> {
    tokens(s).into_iter().filter(|t| !is_stopword(t)).collect()
}

/// Normalised question text for deduplication.
pub fn normalize_question(q: &str) -> String {
    tokens(q).join(" ")
}

/// Removes final sentence punctuation (and closers after it).
pub(super) fn strip_final(s: &str) -> &str {
    s.trim().trim_end_matches(['.', '!', '?', ';', ':', ',', '…', '"', '”', '’', ')']).trim_end()
}
