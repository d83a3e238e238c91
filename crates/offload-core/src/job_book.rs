//! [`JobBook`]: the ledger of a tier's jobs in flight, shared by the tiers so that none
//! re-implements it: which jobs were accepted (and their keys), which were asked to cancel, that
//! each completes exactly once naming only its own keys, and the orphans left when a tier's
//! workers are gone. Pure bookkeeping: no I/O, no clock, no threads.

use std::collections::BTreeMap;

use crate::key::{ChunkKey, JobId};
use crate::tier::{SubmitError, TierCompletion, TierFailure, TierJob};

/// A job in the book: its keys, whether a cancel was asked, and the tier's own data about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Booked<T> {
    /// The job's keys, in the job's order.
    pub keys: Vec<ChunkKey>,
    /// Whether [`JobBook::cancel`] was called for it.
    pub cancelled: bool,
    /// What the tier keeps about the job (its route, its whole `TierJob`, ...).
    pub value: T,
}

/// Why [`JobBook::complete`] refused a completion: each is a broken invariant of the tier (a
/// second completion, or one for a job never accepted, or failed keys the job does not name).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BookError {
    /// No job with this id is in flight (never accepted, or completed already).
    #[error("completion of job {} which is not in flight", .0 .0)]
    NotInFlight(JobId),
    /// The completion lists a failed key its job does not name.
    #[error("job {} lists failed key {:#x}/{} that it does not name", .id.0, .key.hash, .key.group)]
    StrayKey {
        /// The job.
        id: JobId,
        /// The key.
        key: ChunkKey,
    },
    /// The completion lists a failed key twice.
    #[error("job {} lists failed key {:#x}/{} twice", .id.0, .key.hash, .key.group)]
    KeyTwice {
        /// The job.
        id: JobId,
        /// The key.
        key: ChunkKey,
    },
}

/// The jobs a tier accepted and has not reported yet, at most `jobs_max` of them.
///
/// A tier checks a job with [`JobBook::check`] before taking it (duplicate id: `Invalid`; full:
/// `Busy`), books it with [`JobBook::insert`] once it took it, asks [`JobBook::cancel`] whether a
/// cancel is new, and passes every completion through [`JobBook::complete`] before handing it
/// out: exactly once per job, failed keys only of that job. When its workers are gone,
/// [`JobBook::fail_where`] fails what they left, every key with one kind.
#[derive(Clone, Debug)]
pub struct JobBook<T = ()> {
    jobs: BTreeMap<JobId, Booked<T>>,
    jobs_max: usize,
}

impl<T> JobBook<T> {
    /// An empty book that holds at most `jobs_max` jobs.
    pub fn new(jobs_max: usize) -> Self {
        Self {
            jobs: BTreeMap::new(),
            jobs_max,
        }
    }

    /// Jobs in flight.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether no job is in flight.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The most jobs the book holds.
    pub fn jobs_max(&self) -> usize {
        self.jobs_max
    }

    /// Whether job `id` is in flight.
    pub fn contains(&self, id: JobId) -> bool {
        self.jobs.contains_key(&id)
    }

    /// Job `id`, if in flight.
    pub fn get(&self, id: JobId) -> Option<&Booked<T>> {
        self.jobs.get(&id)
    }

    /// The tier's data about job `id`, if in flight, to change.
    pub fn value_mut(&mut self, id: JobId) -> Option<&mut T> {
        self.jobs.get_mut(&id).map(|b| &mut b.value)
    }

    /// The jobs in flight, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (JobId, &Booked<T>)> {
        self.jobs.iter().map(|(&id, b)| (id, b))
    }

    /// The tier's data about every job in flight, in id order, to change.
    pub fn values_mut(&mut self) -> impl Iterator<Item = (JobId, &mut T)> {
        self.jobs.iter_mut().map(|(&id, b)| (id, &mut b.value))
    }

    /// Whether `job` may be booked now: `Invalid` if its id is in flight, `Busy` if the book is
    /// full. Changes nothing.
    pub fn check(&self, job: &TierJob) -> Result<(), SubmitError> {
        if self.jobs.contains_key(&job.id) {
            return Err(SubmitError::Invalid(format!(
                "job id {} is already in flight",
                job.id.0
            )));
        }
        if self.jobs.len() >= self.jobs_max {
            return Err(SubmitError::Busy {
                in_flight: self.jobs.len(),
            });
        }
        Ok(())
    }

    /// Books `job`, which the tier took. Refuses (changing nothing) what [`JobBook::check`]
    /// refuses.
    pub fn insert(&mut self, job: &TierJob, value: T) -> Result<(), SubmitError> {
        let keys = job.chunks.iter().map(|c| c.key).collect();
        self.insert_keys(job.id, keys, value)
    }

    /// [`JobBook::insert`] for a tier that handed its job on already: the job's id and keys.
    pub fn insert_keys(
        &mut self,
        id: JobId,
        keys: Vec<ChunkKey>,
        value: T,
    ) -> Result<(), SubmitError> {
        if self.jobs.contains_key(&id) {
            return Err(SubmitError::Invalid(format!(
                "job id {} is already in flight",
                id.0
            )));
        }
        if self.jobs.len() >= self.jobs_max {
            return Err(SubmitError::Busy {
                in_flight: self.jobs.len(),
            });
        }
        let booked = Booked {
            keys,
            cancelled: false,
            value,
        };
        self.jobs.insert(id, booked);
        Ok(())
    }

    /// Marks job `id` as asked to cancel. True only the first time for a job in flight (the tier
    /// then passes the cancel on); false for a job not in flight or already cancelled.
    pub fn cancel(&mut self, id: JobId) -> bool {
        match self.jobs.get_mut(&id) {
            Some(b) if !b.cancelled => {
                b.cancelled = true;
                true
            }
            _ => false,
        }
    }

    /// Whether job `id` is in flight and was asked to cancel.
    pub fn is_cancelled(&self, id: JobId) -> bool {
        self.jobs.get(&id).is_some_and(|b| b.cancelled)
    }

    /// Takes the job of `completion` out of the book and returns it, after checking that it is
    /// in flight and that its failed keys are its own, each once. On an error the book is
    /// unchanged (the completion must not be handed out).
    pub fn complete(&mut self, completion: &TierCompletion) -> Result<Booked<T>, BookError> {
        let id = completion.id;
        let Some(booked) = self.jobs.get(&id) else {
            return Err(BookError::NotInFlight(id));
        };
        for (n, failed) in completion.failed.iter().enumerate() {
            let key = failed.key;
            if !booked.keys.contains(&key) {
                return Err(BookError::StrayKey { id, key });
            }
            if completion.failed[..n].iter().any(|f| f.key == key) {
                return Err(BookError::KeyTwice { id, key });
            }
        }
        self.jobs.remove(&id).ok_or(BookError::NotInFlight(id))
    }

    /// Takes every job in flight for which `pred` holds out of the book, in id order, each with
    /// the completion that fails all of its keys as `kind` (its workers are gone: nothing will
    /// report it otherwise).
    pub fn fail_where(
        &mut self,
        kind: TierFailure,
        mut pred: impl FnMut(JobId, &Booked<T>) -> bool,
    ) -> Vec<(TierCompletion, Booked<T>)> {
        let ids: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(&id, b)| pred(id, b))
            .map(|(&id, _)| id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(booked) = self.jobs.remove(&id) else {
                continue;
            };
            let completion = TierCompletion::all_failed(id, booked.keys.iter().copied(), kind);
            out.push((completion, booked));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::SlotId;
    use crate::tier::{FailedKey, TierChunk, TierOp};

    fn key(n: u64) -> ChunkKey {
        ChunkKey::new(u128::from(n), 0)
    }

    fn job(id: u64, keys: &[u64]) -> TierJob {
        TierJob {
            id: JobId(id),
            request: None,
            op: TierOp::Load,
            chunks: keys
                .iter()
                .enumerate()
                .map(|(i, &k)| TierChunk::new(key(k), SlotId(i as u32), 8))
                .collect(),
        }
    }

    #[test]
    fn a_job_completes_once_with_only_its_own_keys() {
        let mut book = JobBook::new(2);
        book.insert(&job(1, &[1, 2]), 'a').unwrap();
        assert_eq!(
            book.insert(&job(1, &[3]), 'b'),
            Err(SubmitError::Invalid("job id 1 is already in flight".into()))
        );
        book.insert(&job(2, &[3]), 'b').unwrap();
        assert_eq!(
            book.check(&job(3, &[4])),
            Err(SubmitError::Busy { in_flight: 2 })
        );
        let stray = TierCompletion::all_failed(JobId(1), [key(3)], TierFailure::Io);
        assert_eq!(
            book.complete(&stray),
            Err(BookError::StrayKey {
                id: JobId(1),
                key: key(3)
            })
        );
        let twice = TierCompletion {
            id: JobId(1),
            failed: vec![FailedKey::new(key(2), TierFailure::Io); 2],
        };
        assert!(matches!(
            book.complete(&twice),
            Err(BookError::KeyTwice { .. })
        ));
        assert_eq!(book.len(), 2, "a refused completion changes nothing");
        let done = book.complete(&TierCompletion::success(JobId(1))).unwrap();
        assert_eq!((done.keys, done.value), (vec![key(1), key(2)], 'a'));
        assert_eq!(
            book.complete(&TierCompletion::success(JobId(1))),
            Err(BookError::NotInFlight(JobId(1)))
        );
        assert!(book.cancel(JobId(2)) && !book.cancel(JobId(2)) && !book.cancel(JobId(1)));
        assert!(book.is_cancelled(JobId(2)));
        let orphans = book.fail_where(TierFailure::TierDown, |_, _| true);
        assert_eq!(orphans.len(), 1);
        assert_eq!(
            orphans[0].0,
            TierCompletion::all_failed(JobId(2), [key(3)], TierFailure::TierDown)
        );
        assert!(book.is_empty());
    }

    /// A small deterministic PRNG (the core draws no randomness of its own; the test seeds it).
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Random operations against a model (a map of id to keys and cancel flag): every answer
    /// and the book's contents agree after every step.
    #[test]
    fn random_operations_agree_with_a_model() {
        for seed in 0..200u64 {
            let mut rng = seed;
            let jobs_max = 1 + (next(&mut rng) % 6) as usize;
            let mut book: JobBook<u64> = JobBook::new(jobs_max);
            let mut model: BTreeMap<JobId, (Vec<ChunkKey>, bool)> = BTreeMap::new();
            for step in 0..200 {
                let id = JobId(next(&mut rng) % 12);
                let what = format!("seed {seed} step {step}");
                match next(&mut rng) % 5 {
                    0 | 1 => {
                        let keys: Vec<u64> =
                            (0..next(&mut rng) % 4).map(|k| id.0 * 10 + k).collect();
                        let j = job(id.0, &keys);
                        let expected = if model.contains_key(&id) {
                            Err(SubmitError::Invalid(format!(
                                "job id {} is already in flight",
                                id.0
                            )))
                        } else if model.len() >= jobs_max {
                            Err(SubmitError::Busy {
                                in_flight: model.len(),
                            })
                        } else {
                            model.insert(id, (keys.iter().map(|&k| key(k)).collect(), false));
                            Ok(())
                        };
                        assert_eq!(book.insert(&j, id.0), expected, "{what}");
                    }
                    2 => {
                        let fresh = model
                            .get_mut(&id)
                            .is_some_and(|(_, c)| !std::mem::replace(c, true));
                        assert_eq!(book.cancel(id), fresh, "{what}");
                    }
                    3 => {
                        let keys = model.get(&id).map(|(k, _)| k.clone()).unwrap_or_default();
                        let failed: Vec<ChunkKey> = keys
                            .iter()
                            .copied()
                            .filter(|_| next(&mut rng) % 2 == 0)
                            .collect();
                        let c = TierCompletion::all_failed(id, failed, TierFailure::Missing);
                        match (book.complete(&c), model.remove(&id)) {
                            (Ok(b), Some((keys, cancelled))) => {
                                assert_eq!(
                                    (b.keys, b.cancelled, b.value),
                                    (keys, cancelled, id.0),
                                    "{what}"
                                );
                            }
                            (Err(BookError::NotInFlight(got)), None) => {
                                assert_eq!(got, id, "{what}")
                            }
                            (got, want) => panic!("{what}: book {got:?}, model {want:?}"),
                        }
                    }
                    _ => {
                        let odd = |id: JobId| id.0 % 2 == 1;
                        let failed = book.fail_where(TierFailure::TierDown, |id, _| odd(id));
                        let expected: Vec<JobId> =
                            model.keys().copied().filter(|&id| odd(id)).collect();
                        let got: Vec<JobId> = failed.iter().map(|(c, _)| c.id).collect();
                        assert_eq!(got, expected, "{what}");
                        for (c, b) in &failed {
                            let (keys, _) = model.remove(&c.id).expect("in the model");
                            assert_eq!(c.failed_keys().collect::<Vec<_>>(), keys, "{what}");
                            assert_eq!(b.keys, keys, "{what}");
                        }
                    }
                }
                assert_eq!(book.len(), model.len(), "{what}");
                let ids: Vec<JobId> = book.iter().map(|(id, _)| id).collect();
                assert_eq!(ids, model.keys().copied().collect::<Vec<_>>(), "{what}");
                for (&id, (_, cancelled)) in &model {
                    assert_eq!(book.is_cancelled(id), *cancelled, "{what}");
                }
            }
        }
    }
}
