//! Victim selection policies for the segment cleaner.
//!
//! The cleaner itself (reading a victim, relocating its live records and
//! releasing it) lives with the engine in `volume/clean.rs`; this module
//! only decides which segment is cheapest to clean.

use std::fmt;

/// How the cleaner picks victim segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GcPolicy {
    /// The segment with the fewest live bytes.
    Greedy,
    /// LFS's cost-benefit: maximise `(1 - u) * age / (1 + u)`, where `u` is
    /// the live fraction and `age` how long ago the segment's newest data was
    /// written. Cold segments are cleaned at higher utilisation than hot ones.
    #[default]
    CostBenefit,
}

impl GcPolicy {
    pub fn parse(text: &str) -> Result<GcPolicy, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "greedy" => Ok(GcPolicy::Greedy),
            "cost-benefit" | "costbenefit" | "cost_benefit" => Ok(GcPolicy::CostBenefit),
            other => Err(format!(
                "unknown GC policy {other:?}: use greedy or cost-benefit"
            )),
        }
    }

    pub fn to_u8(self) -> u8 {
        match self {
            GcPolicy::Greedy => 1,
            GcPolicy::CostBenefit => 2,
        }
    }

    pub fn from_u8(value: u8) -> Option<GcPolicy> {
        match value {
            1 => Some(GcPolicy::Greedy),
            2 => Some(GcPolicy::CostBenefit),
            _ => None,
        }
    }

    /// Score of a candidate: higher is a better victim. `None` if cleaning it
    /// would gain nothing.
    pub fn score(self, live_bytes: u64, segment_size_bytes: u64, age: u64) -> Option<f64> {
        if live_bytes >= segment_size_bytes {
            return None;
        }
        let utilisation = live_bytes as f64 / segment_size_bytes as f64;
        Some(match self {
            GcPolicy::Greedy => 1.0 - utilisation,
            GcPolicy::CostBenefit => (1.0 - utilisation) * (age as f64 + 1.0) / (1.0 + utilisation),
        })
    }
}

impl fmt::Display for GcPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GcPolicy::Greedy => "greedy",
            GcPolicy::CostBenefit => "cost-benefit",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_prefers_emptier_segments() {
        let emptier = GcPolicy::Greedy.score(10, 100, 0).unwrap();
        let fuller = GcPolicy::Greedy.score(90, 100, 1_000_000).unwrap();
        assert!(emptier > fuller);
        assert_eq!(GcPolicy::Greedy.score(100, 100, 5), None);
    }

    #[test]
    fn cost_benefit_cleans_cold_segments_at_higher_utilisation() {
        let hot_sparse = GcPolicy::CostBenefit.score(50, 100, 10).unwrap();
        let cold_full = GcPolicy::CostBenefit.score(75, 100, 1000).unwrap();
        assert!(cold_full > hot_sparse);
    }

    #[test]
    fn policies_parse() {
        assert_eq!(GcPolicy::parse("greedy"), Ok(GcPolicy::Greedy));
        assert_eq!(GcPolicy::parse("cost-benefit"), Ok(GcPolicy::CostBenefit));
        assert!(GcPolicy::parse("random").is_err());
    }
}
