//! Whether a measure grew without bound over a soak: a plain function of
//! its samples, so the rule can be tested on made-up series.
//!
//! The rule: drop the warm-up (the first [`WARM_UP_FRACTION`] of the run,
//! while caches, allocator arenas and connection pools fill), split the
//! rest in two halves by time, and fail when the highest value of the
//! second half passes the highest of the first by more than the measure's
//! [`Slack`]. Maxima, not means: a hub restart drops the hub's memory to a
//! fresh process's and a cut drops connections for a moment, so the
//! series are sawtooths whose peaks are the steady level; a leak lifts the
//! peaks. A one-off spike in the second half that stays within the slack,
//! or any spike in the first, does not fail the run.
//!
//! A least-squares slope over the same samples is reported too (per
//! minute), for a person to read: it is not judged, since a sawtooth's
//! slope depends on where the run happened to stop.

use serde::Serialize;

/// The share of the run, from its start, that is not judged.
pub const WARM_UP_FRACTION: f64 = 0.2;

/// Samples each half needs for a judgement: with fewer, a half's maximum
/// is one reading and says nothing of a level.
pub const MIN_SAMPLES_PER_HALF: usize = 2;

/// How far the second half's peak may pass the first's before a measure
/// counts as growing: `first × (1 + relative) + absolute`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Slack {
    /// A share of the first half's peak.
    pub relative: f64,
    /// An amount in the measure's unit.
    pub absolute: f64,
}

/// Resident memory (hub and devices). 5 % and 8 MiB: glibc's malloc keeps
/// several arenas per core and gives freed memory back to the system only
/// now and then, and sled's page cache grows in whole pages, so an RSS
/// with no leak wanders by a few MiB between readings. Over an hour the
/// halves' peaks are about 24 minutes apart, so at a base of 100 MiB this
/// catches a leak of about half a MiB a minute (a few KiB per message at
/// the default load) or more; a slower one shows only in the reported
/// slope.
pub const MEMORY_SLACK: Slack = Slack {
    relative: 0.05,
    absolute: 8.0 * 1024.0 * 1024.0,
};

/// Open files (hub and devices). 10 % and 16: a reading may catch
/// connections being replaced after a cut (the old socket not yet closed
/// by the hub, the new one open) and a device being reopened (its store's
/// files briefly twice); a descriptor leaked per reconnect, per restart or
/// per commit adds hundreds over an hour.
pub const FILES_SLACK: Slack = Slack {
    relative: 0.10,
    absolute: 16.0,
};

/// The judgement of one measure.
#[derive(Clone, Debug, Serialize)]
pub struct Judgement {
    /// The measure's name (`hub rss`, `hub fds`, …).
    pub measure: String,
    /// The unit of the figures (`bytes`, `fds`).
    pub unit: String,
    /// The highest value of the first half after warm-up.
    pub first_max: f64,
    /// The highest value of the second half.
    pub second_max: f64,
    /// The most the second half's peak may be: `first_max` plus the slack.
    pub allowed: f64,
    /// Least-squares slope over the judged samples, per minute.
    pub slope_per_min: f64,
    /// Whether the second half's peak passed `allowed`.
    pub grew: bool,
}

impl Judgement {
    /// One line saying how the measure did.
    pub fn sentence(&self) -> String {
        let f = |v: f64| format_value(v, &self.unit);
        if self.grew {
            format!(
                "{} grew: peak {} in the second half against {} in the first (+{}, allowed up to {}); slope {}/min",
                self.measure,
                f(self.second_max),
                f(self.first_max),
                f(self.second_max - self.first_max),
                f(self.allowed),
                f(self.slope_per_min)
            )
        } else {
            format!(
                "{} flat: peak {} in the second half, {} in the first (allowed up to {}); slope {}/min",
                self.measure,
                f(self.second_max),
                f(self.first_max),
                f(self.allowed),
                f(self.slope_per_min)
            )
        }
    }
}

/// A value in its unit, bytes in MiB.
pub fn format_value(v: f64, unit: &str) -> String {
    if unit == "bytes" {
        format!("{:.1} MiB", v / (1024.0 * 1024.0))
    } else {
        format!("{v:.1} {unit}")
    }
}

/// Why a series could not be judged.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum JudgeError {
    /// Too few samples after the warm-up to split in two halves of
    /// [`MIN_SAMPLES_PER_HALF`] each: the run was too short for its
    /// sampling interval.
    #[error(
        "{judged} samples after the warm-up, too few to judge (at least {} needed): run longer or sample more often",
        2 * MIN_SAMPLES_PER_HALF
    )]
    TooFewSamples {
        /// Samples there were after the warm-up.
        judged: usize,
    },
}

/// Judge one series of `(seconds since start, value)`, in time order, of
/// a run that lasted `run_secs`, against `slack`.
///
/// # Errors
/// [`JudgeError::TooFewSamples`] when the samples after the warm-up do
/// not make two halves of [`MIN_SAMPLES_PER_HALF`].
pub fn judge_series(
    measure: &str,
    unit: &str,
    points: &[(f64, f64)],
    run_secs: f64,
    slack: Slack,
) -> Result<Judgement, JudgeError> {
    let warm_up = run_secs * WARM_UP_FRACTION;
    let judged: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.0 >= warm_up).collect();
    let half = judged.len() / 2;
    if half < MIN_SAMPLES_PER_HALF {
        return Err(JudgeError::TooFewSamples {
            judged: judged.len(),
        });
    }
    // With an odd count the middle sample goes to the second half, so a
    // late rise is never left out.
    let (first, second) = judged.split_at(half);
    let max = |s: &[(f64, f64)]| s.iter().map(|p| p.1).fold(f64::MIN, f64::max);
    let (first_max, second_max) = (max(first), max(second));
    let allowed = first_max * (1.0 + slack.relative) + slack.absolute;
    Ok(Judgement {
        measure: measure.to_string(),
        unit: unit.to_string(),
        first_max,
        second_max,
        allowed,
        slope_per_min: slope(&judged) * 60.0,
        grew: second_max > allowed,
    })
}

/// Least-squares slope of `points` (value per second); 0 when the times
/// do not spread.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mt = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mv = points.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for &(t, v) in points {
        num += (t - mt) * (v - mv);
        den += (t - mt) * (t - mt);
    }
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    /// One sample a second for `secs` seconds, the value from `f`.
    fn series(secs: usize, f: impl Fn(f64) -> f64) -> Vec<(f64, f64)> {
        (0..secs).map(|t| (t as f64, f(t as f64))).collect()
    }

    fn judge(points: &[(f64, f64)], slack: Slack) -> Judgement {
        let run = points.last().map_or(0.0, |p| p.0 + 1.0);
        judge_series("hub rss", "bytes", points, run, slack).unwrap()
    }

    #[test]
    fn a_flat_series_passes_with_no_slope() {
        let j = judge(&series(600, |_| 80.0 * MIB), MEMORY_SLACK);
        assert!(!j.grew, "{}", j.sentence());
        assert_eq!(j.slope_per_min, 0.0);
        assert_eq!(j.first_max, 80.0 * MIB);
    }

    #[test]
    fn a_steady_climb_fails_and_its_slope_is_reported() {
        // 1 MiB a minute for an hour: 48 minutes judged, 24 per half.
        let climb = series(3600, |t| 80.0 * MIB + t / 60.0 * MIB);
        let j = judge(&climb, MEMORY_SLACK);
        assert!(j.grew, "{}", j.sentence());
        assert!((j.slope_per_min - MIB).abs() < 1.0, "{}", j.slope_per_min);
        assert!(j.sentence().contains("grew"), "{}", j.sentence());
    }

    #[test]
    fn a_climb_within_the_slack_passes() {
        // 2 MiB over the whole hour: noise, not a leak this rule can tell.
        let j = judge(
            &series(3600, |t| 80.0 * MIB + t / 1800.0 * MIB),
            MEMORY_SLACK,
        );
        assert!(!j.grew, "{}", j.sentence());
        assert!(j.slope_per_min > 0.0);
    }

    #[test]
    fn a_one_off_spike_then_flat_passes_and_a_warm_up_rise_is_not_judged() {
        let spike = series(600, |t| match t as u64 {
            // A warm-up that fills caches: not judged.
            0..=100 => 20.0 * MIB + t * MIB / 2.0,
            // One reading caught mid-burst, in the first half.
            200 => 300.0 * MIB,
            _ => 70.0 * MIB,
        });
        let j = judge(&spike, MEMORY_SLACK);
        assert!(!j.grew, "{}", j.sentence());
        // The same spike in the second half: only within the slack passes.
        let late = series(600, |t| {
            if t as u64 == 500 {
                75.0 * MIB
            } else {
                70.0 * MIB
            }
        });
        assert!(!judge(&late, MEMORY_SLACK).grew);
        let leak = series(600, |t| if t >= 500.0 { 150.0 * MIB } else { 70.0 * MIB });
        assert!(judge(&leak, MEMORY_SLACK).grew);
    }

    #[test]
    fn a_sawtooth_passes() {
        // A hub restarted every 5 minutes that regrows to 90 MiB each time.
        let saw = series(3600, |t| 30.0 * MIB + (t % 300.0) / 300.0 * 60.0 * MIB);
        let j = judge(&saw, MEMORY_SLACK);
        assert!(!j.grew, "{}", j.sentence());
        // Open files: connections dropped by cuts, back within a second.
        let fds = series(3600, |t| {
            if (t as u64).is_multiple_of(15) {
                12.0
            } else {
                40.0
            }
        });
        assert!(!judge(&fds, FILES_SLACK).grew);
    }

    #[test]
    fn a_sawtooth_with_rising_peaks_fails() {
        let saw = series(3600, |t| {
            30.0 * MIB + (t % 300.0) / 300.0 * 60.0 * MIB + t / 60.0 * MIB
        });
        assert!(judge(&saw, MEMORY_SLACK).grew);
    }

    #[test]
    fn open_files_leaking_one_per_reconnect_fail() {
        // A cut every 15 s, each leaving one descriptor behind.
        let fds = series(3600, |t| 40.0 + (t / 15.0).floor());
        let j = judge_series("hub fds", "fds", &fds, 3600.0, FILES_SLACK).unwrap();
        assert!(j.grew, "{}", j.sentence());
        assert!((j.slope_per_min - 4.0).abs() < 0.1, "{}", j.slope_per_min);
    }

    #[test]
    fn too_few_samples_are_an_error_not_a_pass() {
        let few = series(4, |_| 1.0);
        assert_eq!(
            judge_series("hub fds", "fds", &few, 4.0, FILES_SLACK).unwrap_err(),
            JudgeError::TooFewSamples { judged: 3 }
        );
        assert!(judge_series("hub fds", "fds", &series(5, |_| 1.0), 5.0, FILES_SLACK).is_ok());
    }

    #[test]
    fn slope_of_a_line_and_of_nothing() {
        assert!((slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) - 2.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), 0.0);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 5.0)]), 0.0);
    }
}
