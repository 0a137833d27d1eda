mod errors;
mod heap_profile;
mod locations;
mod overhead;
