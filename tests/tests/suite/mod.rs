mod errors;
mod heap_profile;
