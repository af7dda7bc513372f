//! A leaf room everyone may use: what a caught panic said. A panic's
//! payload is a `&str` or a `String` when it came from `panic!` or a
//! failed `unwrap`; anything else has no words.

use std::any::Any;

/// The message a caught panic carried, when it carried one.
pub fn message(p: &(dyn Any + Send)) -> Option<&str> {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
}

#[cfg(test)]
mod tests {
    #[test]
    fn str_and_string_payloads_have_words_others_none() {
        let a = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(super::message(a.as_ref()), Some("plain"));
        let n = 3;
        let b = std::panic::catch_unwind(|| panic!("formatted {n}")).unwrap_err();
        assert_eq!(super::message(b.as_ref()), Some("formatted 3"));
        let c = std::panic::catch_unwind(|| std::panic::panic_any(7u8)).unwrap_err();
        assert_eq!(super::message(c.as_ref()), None);
    }
}
