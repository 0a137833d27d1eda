//! Putting a sample's Python frames among its native ones.
//!
//! Since 3.11 one native call of the eval loop runs a run of Python frames:
//! those from the innermost up to the first marked as its entry. Each run
//! goes just below (leafward of) its eval-loop frame, so that every Python
//! frame stands directly above the native frames it called.

/// `native` (return addresses, leaf first) with `python` (each frame's
/// address and whether it is an entry frame, innermost first) spliced in
/// at the frames `is_eval` says are eval-loop calls. Runs left over (the
/// native unwind stopped short) go at the root end, in order.
pub fn splice(native: &[u64], python: &[(u64, bool)], is_eval: impl Fn(u64) -> bool) -> Vec<u64> {
    let mut runs = python
        .split_inclusive(|&(_, entry)| entry)
        .map(|run| run.iter().map(|&(address, _)| address));
    let mut spliced = Vec::with_capacity(native.len() + python.len());
    for &frame in native {
        if is_eval(frame)
            && let Some(run) = runs.next()
        {
            spliced.extend(run);
        }
        spliced.push(frame);
    }
    spliced.extend(runs.flatten());
    spliced
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVAL: u64 = 0xe0;

    #[test]
    fn each_run_of_python_frames_goes_below_its_eval_call() {
        // malloc's caller, a C function, the inner eval call, a C call,
        // the outer eval call, main.
        let native = [0x10, 0x20, EVAL, 0x30, EVAL, 0x40];
        // Two frames run by the inner call (the second its entry), one by
        // the outer.
        let python = [(0xa1, false), (0xa2, true), (0xb1, true)];
        let spliced = splice(&native, &python, |f| f == EVAL);
        assert_eq!(
            spliced,
            [0x10, 0x20, 0xa1, 0xa2, EVAL, 0x30, 0xb1, EVAL, 0x40]
        );
    }

    #[test]
    fn runs_with_no_eval_frame_left_go_at_the_root_end() {
        let native = [0x10, EVAL];
        let python = [(0xa1, true), (0xb1, true), (0xb2, false)];
        assert_eq!(
            splice(&native, &python, |f| f == EVAL),
            [0x10, 0xa1, EVAL, 0xb1, 0xb2]
        );
        // No Python frames: the native stack as it was.
        assert_eq!(splice(&native, &[], |f| f == EVAL), native);
    }
}
